"""Consensus aggregation and geometric refinement: FedPAGR (Prasad and Khan, paper 004), Secs. 3.3-3.5.

The unit prototypes of eqs. (2)-(3) (client mean, server consensus) are protofl/algorithms/unit.py; the
client's composite loss, consensus projection and head anchoring are torch, in the technique's device
rule (edge_agent/techniques/fedpagr.py). This module is the server half: the technique's options, its
rule (consensus -> refinement -> next round's targets) and the refinement math.

Geometric refinement (eqs. 4-6, Alg. 1 lines 22-28): P (C x m) starts at [p_bar_1; ...; p_bar_C];
T steps of SGD with momentum 0.9 on the unconstrained P, normalising in the forward pass,

    L(P) = sum_c sum_{k in K_c} (1 - p_kc . P_hat_c)                 (eq. 5, agreement)
         + lambda_S * sum_{c != c'} max(0, P_hat_c . P_hat_c' - m)  (eq. 6, separation)

with P_hat the row-normalised P; then rows are projected back to the unit sphere. The separation
sum runs over ordered pairs, each unordered pair counted twice, as the paper states: "the
separation loss sums over all C(C-1) ordered class pairs" (Sec. 4.2.1, and again in Limitations).

The agreement term needs only per-class sums of the client prototypes:
sum_{k in K_c} (1 - p_kc . P_hat_c) = K_c - S_c . P_hat_c with S_c = sum_{k in K_c} p_kc, so the
accumulator keeps S (C x m) and K (C,) and never the uploads.

Gradient, written by hand (numpy only). With G = P_hat P_hat^T and A[c, c'] = 1 where c != c'
and G[c, c'] > m (the hinge is active; at exactly m the subgradient 0 is used, as torch's relu),

    dL/dP_hat = -S + 2 lambda_S A P_hat       (A is symmetric; the 2 is the ordered-pair count)
    dL/dP_c   = (I - P_hat_c P_hat_c^T) dL/dP_hat_c / ||P_c||   (through the normalisation)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from protofl.algorithms import support
from protofl.algorithms.unit import UnitFold, initial_prototypes, normalize_rows, on_wire
from protofl.errors import ConfigError
from protofl.technique import (
    Fold,
    Phase,
    PlanDraft,
    RoundFields,
    ServerRule,
    ServerState,
    Technique,
    Upload,
    flag,
    integer,
    number,
)
from protofl.wire import ProtoSet

if TYPE_CHECKING:
    from protofl.config import FederationConfig

__all__ = [
    "FedPagr",
    "UnitState",
    "refinement_loss_and_grad",
    "geometric_refine",
    "refine_anchor_table",
]


def refinement_loss_and_grad(
    P: np.ndarray,
    S: np.ndarray,
    K: np.ndarray,
    lambda_s: float = 0.5,
    margin: float = 0.3,
) -> tuple[float, np.ndarray]:
    """L(P) of eqs. (4)-(6) and dL/dP (C, m) float64, in closed form.

    L = sum_c (K_c - S_c . P_hat_c) + lambda_s * sum_{c != c'} max(0, P_hat_c . P_hat_c' - margin),
    the second sum over ordered pairs (each unordered pair twice, as in the paper). Every row of P
    must be non-zero: the normalisation has no gradient at 0.
    """
    P = np.asarray(P, dtype=np.float64)
    S = np.asarray(S, dtype=np.float64)
    K = np.asarray(K, dtype=np.float64)
    if P.ndim != 2 or S.shape != P.shape or K.shape != (P.shape[0],):
        raise ValueError(f"refine: need P (C, m), S (C, m), K (C,), got {P.shape}, {S.shape}, {K.shape}")
    norms = np.linalg.norm(P, axis=1)
    if not (norms > 0).all():
        raise ValueError(f"refine: rows {np.flatnonzero(norms == 0).tolist()} of P are zero; they have no direction")
    Ph = P / norms[:, None]
    gram = Ph @ Ph.T
    excess = gram - margin
    active = excess > 0
    np.fill_diagonal(active, False)
    loss = float(K.sum() - (S * Ph).sum() + lambda_s * excess[active].sum())
    g_hat = -S + (2.0 * lambda_s) * (active.astype(np.float64) @ Ph)
    # Remove the radial part: the loss only sees the direction of each row.
    radial = (Ph * g_hat).sum(axis=1, keepdims=True)
    grad = (g_hat - radial * Ph) / norms[:, None]
    return loss, grad


def geometric_refine(
    P0: np.ndarray,
    S: np.ndarray,
    K: np.ndarray,
    steps: int = 5,
    lr: float = 0.01,
    momentum: float = 0.9,
    lambda_s: float = 0.5,
    margin: float = 0.3,
) -> np.ndarray:
    """Alg. 1 lines 22-28: `steps` of SGD with momentum on L, then rows projected to the unit sphere.

    Momentum is torch.optim.SGD's (dampening 0, no Nesterov): v <- momentum * v + g, P <- P - lr * v,
    with v = g on the first step. Returns (C, m) float32.
    """
    return _refine64(P0, S, K, steps, lr, momentum, lambda_s, margin).astype(np.float32)


def _refine64(
    P0: np.ndarray, S: np.ndarray, K: np.ndarray, steps: int, lr: float, momentum: float, lambda_s: float, margin: float
) -> np.ndarray:
    _check_hyper(steps, lr, momentum, lambda_s, margin)
    P = np.array(P0, dtype=np.float64)
    if P.ndim != 2 or not np.isfinite(P).all():
        raise ValueError(f"refine: P0 must be a finite (C, m) array, got shape {P.shape}")
    v = np.zeros_like(P)
    for _ in range(int(steps)):
        _, g = refinement_loss_and_grad(P, S, K, lambda_s, margin)
        v = momentum * v + g
        P -= lr * v
    return normalize_rows(P)


def refine_anchor_table(
    anchors: Mapping[int, np.ndarray],
    masks: np.ndarray | None = None,
    steps: int = 5,
    lr: float = 0.01,
    momentum: float = 0.9,
    lambda_s: float = 0.5,
    margin: float = 0.3,
) -> dict[int, np.ndarray]:
    """Geometric refinement of an anchor table for the combined pipeline (docs/algorithms.md).

    Each anchor is cut to its class's mask support (when masks are given) and normalised; the
    present classes are refined together with S_c = that unit anchor and K_c = 1 (the anchor is
    the only "submission", so agreement pulls towards it and separation pushes apart the classes
    that overlap); off-support dims are zeroed again, the row renormalised on the support, and
    the anchor's original norm restored, so the magnitude the clients align to is unchanged.
    Classes absent from the table take no part. An anchor that is zero on its support has no
    direction and is returned unchanged. Returns float32 vectors.
    """
    _check_hyper(steps, lr, momentum, lambda_s, margin)
    if masks is not None:
        masks = np.asarray(masks)
        if masks.ndim != 2 or masks.dtype != bool:
            raise ValueError(f"refine: masks must be a (C, m) bool array, got {masks.dtype} {masks.shape}")
    out: dict[int, np.ndarray] = {}
    classes, rows, support, lengths = [], [], [], []
    for c, a in sorted(anchors.items(), key=lambda kv: int(kv[0])):
        c = int(c)
        a64 = np.asarray(a, dtype=np.float64)
        if a64.ndim != 1 or not np.isfinite(a64).all():
            raise ValueError(f"refine: anchor for class {c} must be a finite 1-D vector, got shape {a64.shape}")
        if masks is not None:
            if not 0 <= c < masks.shape[0] or masks.shape[1] != a64.shape[0]:
                raise ValueError(f"refine: no mask of length {a64.shape[0]} for class {c} (masks {masks.shape})")
            keep = masks[c]
        else:
            keep = np.ones(a64.shape[0], dtype=bool)
        restricted = np.where(keep, a64, 0.0)
        if not np.linalg.norm(restricted) > 0:
            out[c] = a64.astype(np.float32)
            continue
        classes.append(c)
        rows.append(restricted)
        support.append(keep)
        lengths.append(float(np.linalg.norm(a64)))
    if not classes:
        return out
    dims = {r.shape[0] for r in rows}
    if len(dims) != 1:
        raise ValueError(f"refine: anchors have different lengths {sorted(dims)}")
    P0 = normalize_rows(np.stack(rows))
    refined = _refine64(P0, P0, np.ones(len(classes)), steps, lr, momentum, lambda_s, margin)
    refined = np.where(np.stack(support), refined, 0.0)
    norms = np.linalg.norm(refined, axis=1)
    for i, c in enumerate(classes):
        # Refinement can in principle move all of a row's mass off its support; then the
        # unrefined direction is the only one left that respects the mask.
        direction = refined[i] / norms[i] if norms[i] > 0 else P0[i]
        out[c] = (lengths[i] * direction).astype(np.float32)
    return dict(sorted(out.items()))


def _check_hyper(steps: int, lr: float, momentum: float, lambda_s: float, margin: float) -> None:
    if int(steps) < 0:
        raise ValueError(f"refine: steps must be >= 0, got {steps}")
    for name, val in (("lr", lr), ("momentum", momentum), ("lambda_s", lambda_s), ("margin", margin)):
        if not math.isfinite(float(val)):
            raise ValueError(f"refine: {name} must be finite, got {val!r}")
    if lr < 0 or lambda_s < 0 or not 0 <= momentum < 1:
        raise ValueError(f"refine: need lr >= 0, lambda_s >= 0, 0 <= momentum < 1; got {lr}, {lambda_s}, {momentum}")


# -- the technique ------------------------------------------------------------------------------------
class FedPagr(Technique):
    """FedPAGR: unit prototypes, consensus projection, anchored head, geometric refinement (also of the
    targets of a first prototype phase, when one is on with mean prototypes)."""

    name = "fedpagr"
    order = 40
    options = {
        "consensus": flag("consensus"),  # consensus projection g_k, unit prototypes, head anchoring
        "refine": flag("refine"),
        "refine_steps": integer("refine_steps", 5),
        "refine_lr": number("refine_lr", 0.01),
        "refine_momentum": number("refine_momentum", 0.9),
        "lambda_s": number("lambda_s", 0.5),
        "margin": number("margin", 0.3),
        "beta": number("beta", 0.1),
        "lambda_e": number("lambda_e", 0.1),
        # Alg. 1 trains only f_k and g_k: the anchored head stays fixed during the round. True is the
        # variant that also trains it (a benchmark row).
        "pagr_train_head": flag("pagr_train_head"),
    }

    def active(self, cfg: FederationConfig) -> bool:
        return cfg.prototypes == "unit" or bool(cfg.refine)

    def check(self, cfg: FederationConfig) -> None:
        if not cfg.beta > 0:
            raise ConfigError("beta must be > 0")
        if cfg.consensus and cfg.prototypes != "unit":
            raise ConfigError("consensus (FedPAGR) needs prototypes='unit'")
        if cfg.pagr_train_head and not cfg.consensus:
            raise ConfigError(
                "pagr_train_head is FedPAGR's trained-head variant; it needs consensus=true (prototypes='unit')"
            )
        if cfg.refine and cfg.prototypes == "none":
            raise ConfigError(
                "refine moves prototypes; with prototypes='none' there is nothing to refine: turn refine off"
            )

    def shape(self, draft: PlanDraft, cfg: FederationConfig) -> None:
        if cfg.prototypes == "unit":
            draft.target_label = ["unit"]
        elif cfg.refine and Phase.PROTO not in draft.phases:
            raise ConfigError(
                "refine acts on FedPAGR's unit prototypes (prototypes='unit') or on the targets "
                "of a first prototype phase (public-set anchors on mean prototypes); with neither it "
                "changes nothing: turn refine off or switch one of them on"
            )

    def server_rule(self, model: ServerState) -> ServerRule:
        return FedPagrRule(model)


@dataclass
class UnitState:
    """FedPAGR's server state: the unit prototypes (C, m) on the sphere (restricted to the support masks where
    prototypes travel masked), the next round's targets; None where prototypes are not unit."""

    unit: np.ndarray | None = None


class FedPagrRule(ServerRule):
    fills = frozenset({"targets"})

    def __init__(self, model: ServerState) -> None:
        super().__init__(model)
        self.state = UnitState()

    def init_model(self) -> None:
        cfg = self.model.cfg
        if cfg.prototypes == "unit":
            unit = initial_prototypes(cfg.num_classes, cfg.proto_dim, cfg.seed)
            masks = self.model.rules.support_masks()
            # on masks (spherical CPS) every unit prototype lives on its class's support
            self.state.unit = support.restrict_to_masks(unit, masks) if masks is not None else unit

    def uploads(self) -> Mapping[Phase, tuple[Upload, ...]]:
        return {Phase.TRAIN: (Upload.PROTOS,)} if self.model.plan.prototypes == "unit" else {}

    def unit_prototypes(self) -> np.ndarray | None:
        return self.state.unit

    def folds(self, phase: Phase) -> list[Fold]:
        if phase is Phase.TRAIN and self.state.unit is not None:
            return [ConsensusFold(self.model, self.state)]
        return []

    def round_fields(self, phase: Phase) -> RoundFields | None:
        plan, unit = self.model.plan, self.state.unit
        if phase is not Phase.TRAIN or unit is None:
            return None
        table = on_wire(unit, self.model.rules.support_masks())
        return RoundFields(targets=ProtoSet.from_table(table, plan.proto_width, plan.proto_dtype))

    def adjust_targets(self, table: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        """Refinement of a first phase's anchor table (docs/algorithms.md, the combined pipeline)."""
        cfg, masks = self.model.cfg, self.model.rules.support_masks()
        if not cfg.refine or not table:
            return table
        dense = support.reconstruct_table(table, masks) if masks is not None else table
        out = refine_anchor_table(
            dense,
            masks,
            steps=cfg.refine_steps,
            lr=cfg.refine_lr,
            momentum=cfg.refine_momentum,
            lambda_s=cfg.lambda_s,
            margin=cfg.margin,
        )
        return support.compress_table(out, masks) if masks is not None else out


class ConsensusFold(UnitFold):
    """The training phase's unit prototypes: eq. (3) as a stream, then refinement at the phase's end."""

    def __init__(self, model: ServerState, state: UnitState) -> None:
        assert state.unit is not None
        self.masks = model.rules.support_masks()
        super().__init__(state.unit, self.masks)
        self.model, self.state = model, state

    def finish(self) -> None:
        cfg, model = self.model.cfg, self.model
        S, K = self.acc.sums()
        p_bar = model.rules.adjust_consensus(self.acc.result())
        unit = (
            geometric_refine(
                p_bar,
                S,
                K,
                steps=cfg.refine_steps,
                lr=cfg.refine_lr,
                momentum=cfg.refine_momentum,
                lambda_s=cfg.lambda_s,
                margin=cfg.margin,
            )
            if cfg.refine
            else p_bar
        )
        # Refinement moves rows off their support masks; project them back (after the T steps).
        self.state.unit = support.restrict_to_masks(unit, self.masks) if self.masks is not None else unit
