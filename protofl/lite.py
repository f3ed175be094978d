"""Lite devices (issue 57): what a device without torch can do in a federation, decided once for both sides.

A lite device (`pip install 'protofl-edge[lite]'`: onnxruntime and numpy) trains nothing: it runs the federation's
shared backbone (shipped with the public set as a flat parameter vector, with an ONNX graph of its forward pass whose
weights are graph inputs fed from that vector: `PublicSet.graph`, `PublicSet.layout`) and sends what forward passes
give. It says so at its join (`Join.trains` false); the server plans its uploads by it (`lite_needs`): it is expected
only in the phase whose uploads it can make, and there only for those. A federation it cannot serve refuses it at its
join, with the reason (`lite_refusal`), in the server's log and its status's refusals; the device checks the same rule
against the config before it joins and says the same.

What a lite device serves, by preset:

- the ridge predictor (`ridge = true`, the default `protofl` preset's global predictor; any preset that federates no
  model with `--set ridge=true`): it sends its ridge statistics [triu(G), B] of the backbone's features once, in
  the training phase, exactly what a torch device sends (protofl/algorithms/ridge.py); it takes no part in the
  preset's training exchange (prototypes of a trained model, adapters), which the torch devices carry;
- a preset without the ridge predictor trains the model on every device (every built-in preset but the default,
  docs/how-to/devices.md lists them): a lite device is refused.

torch-free: the plan's view only.
"""

from __future__ import annotations

from protofl.config import FederationConfig
from protofl.plan import Phase, RoundPlan
from protofl.technique import Upload

__all__ = ["lite_needs", "lite_refusal"]


def lite_refusal(cfg: FederationConfig, has_graph: bool) -> str | None:
    """Why a lite device (no torch) cannot serve this federation, or None where it can. (A federation with the ridge
    predictor seals nothing: the config refuses secure aggregation and differential privacy beside it, so a lite
    device, which does neither, never meets them.)"""
    plan = RoundPlan.from_config(cfg)
    if not plan.shared_backbone:
        return (
            f"preset '{cfg.preset}' trains the model on every device and has no shared-backbone predictor for a lite "
            f"device (onnxruntime, no torch) to serve; install torch on this device (pip install "
            f"'protofl-edge[device]'), or run the federation with the ridge predictor (--set ridge=true)"
        )
    if not has_graph:
        return (
            "the server ships no ONNX graph of the shared backbone (`protofl-server start --public-data ...` ships "
            "one where it trains the backbone, with the `device` and `onnx` extras beside the server); install "
            "torch on this device instead (pip install 'protofl-edge[device]')"
        )
    return None


def lite_needs(plan: RoundPlan, phase: Phase) -> tuple[Upload, ...]:
    """What a lite device uploads in `phase`: the ridge statistics (a parameter vector) in the training phase
    (the plan's last), nothing in the others."""
    if plan.shared_backbone and phase is plan.phases[-1]:
        return (Upload.ADAPTER,)
    return ()
