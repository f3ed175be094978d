"""The ridge predictor (Fed3R: Fani et al., "Accelerating Heterogeneous Federated Learning with Closed-form
Classifiers", ICML 2024): one deployable global classifier, solved in closed form from statistics each device
sends once.

Every device embeds its training data with the federation's shared backbone (the model trained on the server's
public set, or a user's checkpoint: it travels once, with the public set; edge_agent/training/backbone.py), h_i in R^d,
appends a constant 1 (the bias), and sends once the sufficient statistics of a ridge regression of one-hot
labels on those features,

    G_k = sum_i [h_i, 1]^T [h_i, 1]        ((d+1) x (d+1), symmetric: its upper triangle travels)
    B_k = sum_i [h_i, 1]^T onehot(y_i)     ((d+1) x C),

as one dense float32 vector [triu(G_k), B_k] (a parameter upload of the training phase; later rounds send it
empty). The server sums them over the devices, G = sum_k G_k, B = sum_k B_k, and solves

    theta = (G + lambda I)^{-1} B,   lambda = ridge_lambda * trace(G) / (d + 1),

so the head is W = theta[:d]^T (C x d), b = theta[d] (C): exactly the ridge classifier a server holding every
device's data would fit on those features, whatever the label skew (the sums do not depend on how the data is
split). The global predictor is the shared backbone with this head; `protofl-export onnx --from run/global`
exports it and `protofl-edge predict` labels with it. lambda relative to the mean diagonal is our choice (Fed3R
fixes an absolute lambda for its features); 1e-3 was fixed before the benchmark's device runs
(bench/results/PREDICTOR.md, where this route beat FedAvg's global model in settings A and B at 0.16 % of its
uplink bytes).

A device sends its statistics in the first round it trains; a repeat from a device already counted (one that lost
its state and sent them again) is not added twice. Only this module knows the layout of the vector; the device
half is edge_agent/techniques/ridge.py. numpy only.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from protofl.errors import WireError
from protofl.technique import (
    Clip,
    ClippedUpload,
    Fold,
    Option,
    Part,
    Phase,
    PlanDraft,
    RoundFields,
    ServerRule,
    ServerState,
    Technique,
    Upload,
    flag,
    integer,
    is_number,
)

__all__ = [
    "Ridge",
    "forget",
    "RidgeState",
    "ridge_head",
    "ridge_length",
    "ridge_solve",
    "ridge_statistics",
    "split_statistics",
]

log = logging.getLogger("protofl.ridge")

LAMBDA = 1e-3  # ridge_lambda's default: relative to the mean diagonal of G (bench/results/PREDICTOR.md)


def ridge_length(dim: int, num_classes: int) -> int:
    """Values of one device's statistics vector: the upper triangle of G and B."""
    d1 = dim + 1
    return d1 * (d1 + 1) // 2 + d1 * num_classes


def ridge_statistics(h: np.ndarray, y: np.ndarray, num_classes: int) -> np.ndarray:
    """A device's upload: [triu(G), B] of features `h` (n, d) and labels `y` (float64 sums, float32 out)."""
    h = np.asarray(h, np.float64)
    n, d = h.shape
    ha = np.empty((n, d + 1))
    ha[:, :d] = h
    ha[:, d] = 1.0
    onehot = np.zeros((n, num_classes))
    onehot[np.arange(n), np.asarray(y, np.int64)] = 1.0
    g = ha.T @ ha
    b = ha.T @ onehot
    return np.concatenate([g[np.triu_indices(d + 1)], b.ravel()]).astype(np.float32)


def split_statistics(vector: np.ndarray, dim: int, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """(G (d+1, d+1) symmetric, B (d+1, C)) from a statistics vector (or a sum of them), float64."""
    d1 = dim + 1
    v = np.asarray(vector, np.float64)
    if v.shape != (ridge_length(dim, num_classes),):
        raise ValueError(f"ridge statistics of length {v.shape}, expected {ridge_length(dim, num_classes)}")
    t = d1 * (d1 + 1) // 2
    g = np.zeros((d1, d1))
    g[np.triu_indices(d1)] = v[:t]
    g = g + np.triu(g, 1).T
    return g, v[t:].reshape(d1, num_classes)


def ridge_solve(g: np.ndarray, b: np.ndarray, lam_rel: float = LAMBDA) -> tuple[np.ndarray, np.ndarray]:
    """theta = (G + lambda I)^-1 B with lambda = lam_rel x the mean diagonal of G; the head (W (C, d), b (C,))."""
    d1 = g.shape[0]
    lam = lam_rel * float(np.trace(g)) / d1
    if not lam > 0:
        raise ValueError("ridge: no statistics to solve from (the trace of G is 0)")
    theta = np.linalg.solve(g + lam * np.eye(d1), b)
    return np.ascontiguousarray(theta[:-1].T, np.float32), np.ascontiguousarray(theta[-1], np.float32)


def ridge_head(
    vector: np.ndarray, dim: int, num_classes: int, lam_rel: float = LAMBDA
) -> tuple[np.ndarray, np.ndarray]:
    """The closed-form head from summed statistics."""
    return ridge_solve(*split_statistics(vector, dim, num_classes), lam_rel)


def _check_lambda(value: Any) -> str | None:
    if not is_number(value):
        return f"config 'ridge_lambda' must be a finite number, got {value!r}"
    return None if value > 0 else f"ridge_lambda must be > 0 (relative to the mean diagonal of G), got {value}"


class Ridge(Technique):
    """The closed-form global head on the shared backbone; the switch `ridge`."""

    name = "ridge"
    order = 95  # after every technique that shapes the training phase's uploads
    options = {
        "ridge": flag("ridge"),
        "ridge_lambda": Option(LAMBDA, _check_lambda),
        # Epochs of the shared backbone's training on the public set (edge_agent/training/backbone.py); 0: the seeded
        # initial model is the backbone (random features), as it is without a public set.
        "backbone_epochs": integer("backbone_epochs", 60, 0),
    }

    def active(self, cfg: Any) -> bool:
        # A predictor for federations that share no model. Where one is federated (federate = "full" or
        # "adapter": the protofl preset with `--set federate=adapter`), that model is the global predictor, and
        # its parameter upload is the one the statistics would ride: the switch then does nothing (docs/algorithms.md).
        return bool(cfg.options.get("ridge")) and cfg.federate == "none"

    def shape(self, draft: PlanDraft, cfg: Any) -> None:
        draft.shared_backbone = True
        last = draft.phases[-1]
        kinds = set(draft.uploads.get(last, ())) | {Upload.ADAPTER}
        draft.uploads = {**draft.uploads, last: tuple(k for k in Upload if k in kinds)}

    def server_rule(self, model: ServerState) -> ServerRule:
        return RidgeRule(model)


@dataclass
class RidgeState:
    """The summed statistics of every device counted so far, and who they are (sorted)."""

    stats: np.ndarray | None = None  # float64, ridge_length(d, C)
    contributors: list[str] = field(default_factory=list)
    samples: int = 0


def forget(state: RidgeState, client: str, stats: np.ndarray, dim: int, num_classes: int) -> RidgeState:
    """`state` without `client`: its statistics vector `stats` (as it sent them) subtracted from the sums, its name
    and samples taken out. The head solved from the result is the one of a federation that never had it, as far as
    the sums go: G and B are sums, so G - G_k and B - B_k are what the others' statistics sum to (exactly, where the
    float64 sums of the float32 vectors were: they are, unless their magnitudes span more than 2^29). It does not
    undo what the device's uploads did to anything else: a backbone its updates shaped stays shaped by them."""
    if client not in state.contributors:
        raise ValueError(f"ridge: {client} contributed no statistics to forget")
    g, b = split_statistics(stats, dim, num_classes)
    assert state.stats is not None
    rest = [c for c in state.contributors if c != client]
    left = np.asarray(state.stats, np.float64) - np.asarray(stats, np.float64)
    return RidgeState(
        stats=left if rest else None, contributors=rest, samples=state.samples - int(round(float(g[-1, -1])))
    )


class RidgeRule(ServerRule):
    fills = frozenset({"predictor"})

    def __init__(self, model: ServerState) -> None:
        super().__init__(model)
        self.state = RidgeState()
        cfg = model.cfg
        self.dim, self.classes = int(cfg.proto_dim), int(cfg.num_classes)
        self.length = ridge_length(self.dim, self.classes)
        self._head: tuple[int, tuple[np.ndarray, np.ndarray] | None] = (-1, None)

    def uploads(self) -> Mapping[Phase, tuple[Upload, ...]]:
        return {self.model.plan.phases[-1]: (Upload.ADAPTER,)}

    def folds(self, phase: Phase) -> list[Fold]:
        return [RidgeFold(self)] if phase is self.model.plan.phases[-1] else []

    def round_fields(self, phase: Phase) -> RoundFields | None:
        """The head in the final round message: every device keeps the federation's predictor beside its model."""
        return RoundFields(predictor=self.predictor_head()) if phase is Phase.DONE else None

    def predictor_head(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The global head (W (C, d), b (C,)) from the statistics counted so far; None before any."""
        st = self.state
        if st.stats is None or not st.contributors:
            return None
        key, head = self._head
        if key != len(st.contributors) or head is None:
            head = ridge_head(st.stats, self.dim, self.classes, float(self.model.cfg.ridge_lambda))
            self._head = (len(st.contributors), head)
        return head

    def predictor_info(self) -> dict[str, Any]:
        st = self.state
        return {"kind": "ridge", "devices": len(st.contributors), "samples": int(st.samples)}


class RidgeFold(Fold):
    """The training phase's statistics vectors: checked, summed; an empty one (a device that sent its own before)
    adds nothing."""

    kinds = (Upload.ADAPTER,)
    # Statistics are sums over a device's samples, not a model: there is no centre to clip them around, and a
    # norm bound would bias the fit. They are checked instead (shape, counts, G's diagonal).
    clip: Mapping[Part, Clip | None] = {Part.UPDATE: None}
    merged = ("stats", "senders", "samples")

    def __init__(self, rule: RidgeRule) -> None:
        self.rule = rule
        self.stats = np.zeros(rule.length)
        self.senders: list[str] = []
        self.samples = 0

    def check(self, up: ClippedUpload) -> Any:
        update = up.update
        assert update is not None
        rule = self.rule
        if update.n != rule.length:
            raise WireError(
                f"ridge statistics of length {update.n}, expected {rule.length} "
                f"(features of {rule.dim} values, {rule.classes} classes)"
            )
        if update.indices is not None:
            if update.indices.size:
                raise WireError("ridge statistics travel dense (or empty, once sent)")
            return None
        v = np.asarray(update.vector, np.float64)
        g, b = split_statistics(v, rule.dim, rule.classes)
        n = g[-1, -1]
        # Statistics of the device's data, sent once: folded as sent, whatever weight an older upload's
        # prototypes get (checked against the count the device sent, not the weighted one).
        sent = up.n_samples / up.weight
        if abs(n - sent) > 1e-6 * max(1.0, sent) or not n >= 1:
            raise WireError(f"ridge statistics count {n:g} samples, the upload says {sent:g}")
        counts = b[-1]
        if (counts < 0).any() or abs(float(counts.sum()) - n) > 0.5:
            raise WireError("ridge statistics: the class counts do not sum to the samples")
        if (np.diag(g) < 0).any():
            raise WireError("ridge statistics: G has a negative diagonal (not a sum of squares)")
        if up.sender and up.sender in rule.state.contributors:
            log.info("ridge: %s sent its statistics again; they were counted already, not added twice", up.sender)
            return None
        return v, up.sender, int(n)

    def fold(self, prepared: Any) -> None:
        if prepared is None:
            return
        v, sender, n = prepared
        self.stats += v
        self.senders.append(sender)
        self.samples += n

    def partial(self) -> dict[str, Any]:
        return {"stats": self.stats.copy(), "senders": list(self.senders), "samples": self.samples}

    def merge(self, part: Mapping[str, Any], *, check: bool = False) -> None:
        if not isinstance(part, Mapping) or set(part) != set(self.merged or ()):
            raise ValueError(f"RidgeFold: partial has {sorted(part) if isinstance(part, Mapping) else part!r}")
        stats, senders, samples = part["stats"], part["senders"], part["samples"]
        if not isinstance(stats, np.ndarray) or stats.shape != self.stats.shape or not np.isfinite(stats).all():
            raise ValueError(f"RidgeFold.stats: expected a finite array of shape {self.stats.shape}")
        if not isinstance(senders, list) or not all(isinstance(s, str) for s in senders):
            raise ValueError("RidgeFold.senders: expected a list of client ids")
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
            raise ValueError("RidgeFold.samples: expected an integer >= 0")
        if check:
            return
        self.stats += stats
        self.senders.extend(senders)
        self.samples += samples

    def finish(self) -> None:
        if not self.senders:
            return
        st = self.rule.state
        st.stats = self.stats.copy() if st.stats is None else st.stats + self.stats
        st.contributors = sorted([*st.contributors, *self.senders])  # (sorted: the same however shards merged)
        st.samples += self.samples
