"""Export a client model to ONNX for inference-time prototype extraction.

Part of the device runtime: the ``onnx`` extractor re-exports the model on the device whenever its
weights changed, and a frozen backbone is exported once; ``protofl-export onnx`` builds on the same
function.

Three graphs can be exported (``what``):

* ``features``: x -> backbone -> stem -> adapter [-> projection] -> z, the prototype-space embedding
  (what a device needs to compute prototypes and classify by nearest prototype);
* ``backbone``: x -> h, for a frozen backbone whose features are cached while the rest trains;
* ``logits``: x -> ... -> z -> head -> class scores, a classifier of its own (a federation's global
  predictor: FedAvg's model, or the federated adapter and head on a shared backbone).

The input is the *normalised* float32 image batch ``(batch, c, h, w)`` exactly as the torch model
takes it; the normalisation to apply to raw pixels travels in the model's metadata, with the
architecture, dimensions and the exporter used. The batch axis is dynamic.

``torch.onnx.export(dynamo=True)`` (torch.export + onnxscript) is tried first; if it is unavailable or
fails, the legacy TorchScript exporter is used and the metadata says so.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from edge_agent.training.models import ProtoNet, eval_mode
from protofl import __version__
from protofl.errors import ConfigError, ProtoFLError

__all__ = ["EXPORTERS", "WHAT", "ExportError", "ExportInfo", "export_onnx", "graph_of"]

WHAT = ("features", "backbone", "logits")
EXPORTERS = ("auto", "dynamo", "torchscript")
LEGACY_MAX_OPSET = 20  # the TorchScript exporter's newest opset in torch 2.x
log = logging.getLogger("protofl.export")


class ExportError(ProtoFLError, RuntimeError):
    """Neither exporter could produce an ONNX graph for the model."""


@dataclass(frozen=True)
class ExportInfo:
    path: Path
    what: str
    exporter: str  # "dynamo" or "torchscript"
    opset: int
    out_dim: int
    seconds: float
    fallback_reason: str = ""


class _Graph(nn.Module):
    """The part of a ProtoNet that is exported: ``features`` (z) or ``backbone`` (h)."""

    def __init__(self, model: ProtoNet, what: str) -> None:
        super().__init__()
        self.model = model
        self.what = what

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.what == "backbone":
            return self.model.backbone_features(x)
        if self.what == "logits":
            return self.model.head(self.model.features(x))
        return self.model.features(x)


def graph_of(model: ProtoNet, what: str) -> nn.Module:
    """The exported part of ``model`` as a module (what verify and bench compare with the ONNX graph)."""
    if what not in WHAT:
        raise ConfigError(f"--what must be one of {', '.join(WHAT)}, got {what!r}")
    return _Graph(model, what)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    # The exporters print progress and warn about unrelated optional packages (torchvision ops);
    # a CLI user needs neither. Real failures still raise.
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._dynamo", "onnxscript")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _export_dynamo(graph: nn.Module, example: torch.Tensor, path: Path, opset: int | None) -> None:
    batch = torch.export.Dim("batch", min=1)
    program = torch.onnx.export(
        graph,
        (example,),
        dynamo=True,
        verbose=False,
        opset_version=opset,
        input_names=["x"],
        output_names=["out"],
        dynamic_shapes=({0: batch},),
    )
    if program is None:
        raise ExportError("torch.onnx.export(dynamo=True) returned no program")
    program.save(str(path), external_data=False)


def _export_torchscript(graph: nn.Module, example: torch.Tensor, path: Path, opset: int | None) -> None:
    torch.onnx.export(
        graph,
        (example,),
        str(path),
        dynamo=False,
        opset_version=min(opset or 17, LEGACY_MAX_OPSET),
        input_names=["x"],
        output_names=["out"],
        dynamic_axes={"x": {0: "batch"}, "out": {0: "batch"}},
        do_constant_folding=True,
    )


def export_onnx(
    model: ProtoNet,
    out: str | os.PathLike[str],
    *,
    what: str = "features",
    opset: int | None = None,
    mean: tuple[float, ...] | None = None,
    std: tuple[float, ...] | None = None,
    exporter: str = "auto",
    metadata: dict[str, str] | None = None,
) -> ExportInfo:
    """Export ``model`` (``what`` = features | backbone | logits) to ``out`` with a dynamic batch axis and
    metadata.

    ``mean``/``std`` are the per-channel normalisation (in [0, 1] pixel units) the model was trained with;
    they are recorded, not baked into the graph. ``opset`` None means the exporter's default. ``metadata``:
    more entries to record (e.g. the class names, the prototype file that goes with the graph).
    """
    if what not in WHAT:
        raise ConfigError(f"--what must be one of {', '.join(WHAT)}, got {what!r}")
    if exporter not in EXPORTERS:
        raise ConfigError(f"exporter must be one of {', '.join(EXPORTERS)}, got {exporter!r}")
    import onnx  # optional dependency: the `onnx` extra

    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    c = model.in_shape[0]
    mean = tuple(mean) if mean is not None else (0.0,) * c
    std = tuple(std) if std is not None else (1.0,) * c
    if len(mean) != c or len(std) != c:
        raise ConfigError(f"normalisation needs one mean/std per input channel ({c}), got {mean} / {std}")
    graph = _Graph(model, what)
    # Batch 2, not 1: an example batch of 1 lets the tracer specialise the batch axis to a constant.
    example = torch.zeros((2, *model.in_shape), device=next(model.parameters()).device)
    start = time.perf_counter()
    used, reason = "dynamo", ""
    with eval_mode(model), torch.no_grad(), _quiet():
        if exporter in ("auto", "dynamo"):
            try:
                _export_dynamo(graph, example, path, opset)
            except Exception as exc:  # noqa: BLE001 -- any exporter failure means: try the other one
                if exporter == "dynamo":
                    raise ExportError(f"dynamo export of {model.arch} failed: {exc}") from exc
                used, reason = "torchscript", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                log.warning("dynamo export failed (%s); falling back to the TorchScript exporter", reason)
        else:
            used = "torchscript"
        if used == "torchscript":
            try:
                _export_torchscript(graph, example, path, opset)
            except Exception as exc:  # noqa: BLE001
                raise ExportError(
                    f"ONNX export of {model.arch} ({what}) failed with both exporters: "
                    f"dynamo: {reason or 'not tried'}; torchscript: {exc}"
                ) from exc
    seconds = time.perf_counter() - start

    proto = onnx.load(str(path))
    out_dim = {"backbone": model.backbone_dim, "logits": model.num_classes}.get(what, model.proto_dim)
    meta = {
        "protofl_version": __version__,
        "what": what,
        "arch": model.arch,
        "in_shape": ",".join(str(v) for v in model.in_shape),
        "out_dim": str(out_dim),
        "proto_dim": str(model.proto_dim),
        "backbone_dim": str(model.backbone_dim),
        "num_classes": str(model.num_classes),
        "norm_mean": ",".join(repr(float(v)) for v in mean),
        "norm_std": ",".join(repr(float(v)) for v in std),
        "input": "float32 (batch, c, h, w), normalised: (pixel / 255 - norm_mean) / norm_std",
        "exporter": used,
        **(metadata or {}),
    }
    meta = {e.key: e.value for e in proto.metadata_props} | meta  # keep whatever the exporter recorded
    del proto.metadata_props[:]
    for key, value in meta.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    proto.producer_name = "protofl-export"
    onnx.save(proto, str(path))
    opset_used = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)
    return ExportInfo(path, what, used, int(opset_used), out_dim, seconds, reason)
