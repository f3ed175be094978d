"""Prototype scaling: TinyProto (Lee et al., paper 002), Sec. 4.2, eqs. (10) and (11).

Client half, local scaling: instead of (p_kc, n_kc) the client sends the single vector n_kc * p_kc
(compressed to its class's support when masks are on), so the server never sees the label histogram.

Server half, eq. (10), over the clients N_c that sent class c:

    G_c = (1 / |N_c|) * sum_{k in N_c} n_kc p_kc

for every class that anybody sent. The published code aggregated only the first class and
dropped the 1 / |N_c|; neither is copied here.

Client again, global scaling, eq. (11): align to mu * G_c, mu a hyperparameter (paper: 1.5e-4 for
CIFAR-10, 1.5e-3 for CIFAR-100 and TinyImageNet), or with mu = "auto" to G_c rescaled to the norm
of the client's own prototype for c: direction from the federation, magnitude local, no
dataset-dependent constant. For classes the client does not hold (no local norm) "auto" uses the
median of the client's local norms: a typical magnitude for this client's feature space that one
outlying class cannot drag.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from protofl.algorithms.fedproto import PrototypeAggregator
from protofl.mergeable import Additive

__all__ = ["scale_prototypes", "support_norms", "ScaledAggregator", "apply_mu", "auto_rescale"]


def scale_prototypes(protos: Mapping[int, np.ndarray], counts: Mapping[int, int]) -> dict[int, np.ndarray]:
    """n_kc * p_kc for every class in `protos`, as float32."""
    out: dict[int, np.ndarray] = {}
    for c, p in protos.items():
        if c not in counts:
            raise ValueError(f"scaling: class {c} has a prototype but no sample count")
        n = counts[c]
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or int(n) <= 0:
            raise ValueError(f"scaling: sample count for class {c} must be a positive integer, got {n!r}")
        v = np.asarray(p, dtype=np.float64)
        if not np.isfinite(v).all():
            raise ValueError(f"scaling: prototype for class {c} contains NaN or inf")
        out[int(c)] = (int(n) * v).astype(np.float32)
    return out


def support_norms(protos: Mapping[int, np.ndarray], masks: np.ndarray | None) -> dict[int, float]:
    """||p_kc|| on the class's support mask (the whole vector without masks): what mu = "auto" rescales to."""
    out: dict[int, float] = {}
    for c, p in protos.items():
        v = np.asarray(p)
        out[int(c)] = float(np.linalg.norm(v[masks[int(c)]] if masks is not None else v))
    return out


class ScaledAggregator(Additive):
    """Eq. (10) as a stream: per class, the plain mean of the scaled vectors over the clients that sent it.

    `dim` is the length of what travels: m without masks, s with them.
    """

    additive = ("_agg",)  # mergeable across aggregator shards

    def __init__(self, num_classes: int, dim: int) -> None:
        # Eq. (10) is an unweighted mean over senders of the scaled vectors; the weighting is
        # already inside n_kc p_kc.
        self._agg = PrototypeAggregator(num_classes, dim, weighting="mean")

    @property
    def senders(self) -> int:
        """How many uploads have been accepted."""
        return self._agg.senders

    def add(self, scaled: Mapping[int, np.ndarray]) -> None:
        """Fold in one client's {c: n_kc p_kc}; a rejected upload leaves the state unchanged."""
        self._agg.add(scaled, None)

    def check_rows(self, classes: np.ndarray, shape: tuple[int, ...], counts: np.ndarray | None = None) -> None:
        """PrototypeAggregator.check_rows for one upload's rows of this shape (counts are not used)."""
        self._agg.check_rows(classes, shape, None)

    def add_many(self, classes: list[np.ndarray], rows: np.ndarray, counts: np.ndarray | None, uploads: int) -> None:
        """`add` for several checked uploads as rows (PrototypeAggregator.add_many; counts are not used)."""
        self._agg.add_many(classes, rows, None, uploads)

    def check(self, scaled: Mapping[int, np.ndarray]) -> None:
        """Raise ValueError if `add` would reject this table; changes nothing."""
        self._agg.check(scaled, None)

    def result(self) -> dict[int, np.ndarray]:
        """G_c as float32 for every class somebody sent."""
        return self._agg.result()


def apply_mu(global_scaled: Mapping[int, np.ndarray], mu: float) -> dict[int, np.ndarray]:
    """Eq. (11)'s alignment target mu * G_c, as float32."""
    mu = float(mu)
    if not math.isfinite(mu) or mu <= 0.0:
        raise ValueError(f"scaling: mu must be a finite number > 0 (paper: 1.5e-4 for CIFAR-10), got {mu!r}")
    return {int(c): (mu * np.asarray(g, dtype=np.float64)).astype(np.float32) for c, g in global_scaled.items()}


def auto_rescale(global_scaled: Mapping[int, np.ndarray], local_norms: Mapping[int, float]) -> dict[int, np.ndarray]:
    """mu = "auto": G_c scaled to ||p_kc|| of this client (median of its norms for classes it lacks).

    Pass the norms of the prototypes as the client compares them (structured-sparse ones when masks
    is on), so that target and features live on the same scale. A zero G_c stays zero: it has no
    direction to keep.
    """
    norms = {int(c): float(v) for c, v in local_norms.items()}
    bad = {c: v for c, v in norms.items() if not math.isfinite(v) or v < 0.0}
    if bad:
        raise ValueError(f"scaling: local norms must be finite and >= 0, got {bad}")
    if not norms:
        raise ValueError("scaling: auto rescale needs at least one local prototype norm; use a fixed mu instead")
    fallback = float(np.median(list(norms.values())))
    out: dict[int, np.ndarray] = {}
    for c, g in global_scaled.items():
        g64 = np.asarray(g, dtype=np.float64)
        if not np.isfinite(g64).all():
            raise ValueError(f"scaling: global prototype for class {c} contains NaN or inf")
        length = float(np.linalg.norm(g64))
        if length == 0.0:
            out[int(c)] = np.zeros_like(g64, dtype=np.float32)
            continue
        out[int(c)] = (g64 * (norms.get(int(c), fallback) / length)).astype(np.float32)
    return out
