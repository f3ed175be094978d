"""Bounded uploads against a poisoning client: centred norm clipping and coordinate-wise robust means.

Clipping (norm bounding as in Sun et al. 2019, "Can You Really Backdoor Federated Learning?", centred
on the current global value as in Karimireddy et al. 2021, "Learning from History for Byzantine Robust
Optimization"): an upload u for a value whose global is c becomes

    clip(u; c, R) = c + (u - c) * min(1, R / ||u - c||)

Every clipped upload lies in the ball of radius R around c, and a weighted mean of points in a ball
stays in it whatever the weights: one client, however many samples it claims, moves a global value
by at most R in one round. R is derived from the federation's own statistics: `factor` times the
median norm ||u|| of the uploads the previous round accepted (a minority cannot move a median, and
unlike distances to c, norms do not grow when a poisoner has dragged c away); the first round, with
no statistics yet, uses the configured `first_radius`.

Switch: `ClipPolicy(enabled=False)` (`--clip off`) folds uploads as they came: no radius, nothing
counted. Clipping is a defence, not part of any paper's method: with it on, a method whose honest
uploads differ widely in norm (TinyProto's scaled prototypes grow with the class count n_kc) is no
longer the paper's aggregation.

Limits: within R, a client that claims a huge sample count still gets most of the weight of a
weighted mean, so it can use the whole radius every round (the robust modes ignore claimed counts);
and the first round's radius is only as tight as `first_radius`.

Robust aggregation (Yin et al. 2018, "Byzantine-Robust Distributed Learning", coordinate-wise median
and trimmed mean): unweighted (claimed sample counts are not trusted), over the clients that sent a
coordinate. These hold every upload (n x d): memory grows with the clients, unlike the streaming means.
numpy only; nothing here knows about MQTT.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from protofl.mergeable import Additive

ROBUST_MODES = ("mean", "median", "trimmed")
DEFAULT_FACTOR = 10.0  # generous: honest uploads of one round are far nearer the median than 10x
DEFAULT_FIRST_RADIUS = 1e4  # round 1, before any statistics (the models' features are O(1..100))
DEFAULT_TRIM = 0.2  # trimmed mean: drop this share of the senders at each end (2 of 10)


def clip_around(u: np.ndarray, center: np.ndarray, radius: float) -> tuple[np.ndarray, float]:
    """(clip(u; center, radius), ||u - center||) in float64."""
    u64 = np.asarray(u, dtype=np.float64)
    d = u64 - center
    dist = float(np.sqrt(np.dot(d, d)))
    if dist <= radius:
        return u64, dist  # u itself, not center + d: that would round, and change honest results
    return center + d * (radius / dist), dist


@dataclass(frozen=True)
class ClipPolicy:
    """How uploads are bounded: radius = factor x median accepted upload norm of the previous round."""

    factor: float = DEFAULT_FACTOR
    first_radius: float = DEFAULT_FIRST_RADIUS
    robust: str = "mean"  # mean | median | trimmed
    trim: float = DEFAULT_TRIM
    enabled: bool = True  # off: uploads are folded unclipped and nothing is counted

    def __post_init__(self) -> None:
        if not (math.isfinite(self.factor) and self.factor > 0):
            raise ValueError(f"clip factor must be a finite number > 0, got {self.factor}")
        if not (math.isfinite(self.first_radius) and self.first_radius > 0):
            raise ValueError(f"first-round clip radius must be a finite number > 0, got {self.first_radius}")
        if self.robust not in ROBUST_MODES:
            raise ValueError(f"robust aggregation must be one of {', '.join(ROBUST_MODES)}, got '{self.robust}'")
        if not 0.0 <= self.trim < 0.5:
            raise ValueError(f"trim must be in [0, 0.5), got {self.trim}")

    def radius(self, previous_norms: list[float]) -> float:
        """The next round's radius from this round's accepted norms (first radius if none or all zero)."""
        if not previous_norms:
            return self.first_radius
        med = float(np.median(previous_norms))
        return self.factor * med if med > 0 else self.first_radius


    def rule(self) -> str:
        """The radius rule in words (the server's one explanatory log line)."""
        return (f"radius = {self.factor:g} x the median norm of the previous round's accepted uploads of that "
                f"kind; {self.first_radius:g} before any")


class NormLog:
    """The norms ||u|| of one round's accepted uploads (for the next radius) and how many were clipped."""

    def __init__(self) -> None:
        self.values: list[float] = []
        self.clipped = 0

    def record(self, u: np.ndarray, dist: float, radius: float) -> None:
        u = np.asarray(u, dtype=np.float64)
        self.values.append(float(np.sqrt(np.dot(u, u))))
        self.clipped += dist > radius


@dataclass
class ClipCount:
    """Rows checked against the radius and rows clipped, per kind ("protos", "anchors", "adapter").

    A row is one class's prototype or anchor, or one whole parameter vector for "adapter"."""

    checked: dict[str, int] = field(default_factory=dict)
    clipped: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, log: NormLog) -> None:
        """One closed phase's log of `kind`."""
        if log.values:
            self.checked[kind] = self.checked.get(kind, 0) + len(log.values)
        if log.clipped:
            self.clipped[kind] = self.clipped.get(kind, 0) + log.clipped

    def copy(self) -> ClipCount:
        """An independent snapshot (the model's own count is reset when the next round opens)."""
        return ClipCount(dict(self.checked), dict(self.clipped))

    def text(self) -> str:
        """'3/60 protos, 0/10 adapter': clipped of checked, per kind (empty when nothing was checked)."""
        return clip_text(self.clipped, self.checked)


def clip_text(clipped: Mapping[str, int], checked: Mapping[str, int]) -> str:
    """'3/60 protos, 0/10 adapter': rows clipped of rows checked, per kind (empty when nothing was checked)."""
    return ", ".join(f"{clipped.get(k, 0)}/{n} {k}" for k, n in sorted(checked.items()))


class CoordinateRobust(Additive):
    """Coordinate-wise median or trimmed mean of the uploads, over the senders of each coordinate."""

    additive = ("_rows",)  # every row: merging is exact (the rows are sorted per coordinate at the end)

    def __init__(self, dim: int, mode: str, trim: float = DEFAULT_TRIM) -> None:
        if mode not in ("median", "trimmed"):
            raise ValueError(f"robust mode must be median or trimmed, got '{mode}'")
        self.dim, self.mode, self.trim = dim, mode, trim
        self._rows: list[np.ndarray] = []

    @property
    def senders(self) -> int:
        return len(self._rows)

    def add(self, values: np.ndarray, index: np.ndarray | None = None) -> None:
        """One upload: dense `values` (dim,), or `values` at sorted unique `index` (the rest not sent)."""
        row = np.full(self.dim, np.nan, dtype=np.float64)
        if index is None:
            if np.shape(values) != (self.dim,):
                raise ValueError(f"robust aggregate: expected {self.dim} values, got shape {np.shape(values)}")
            row[:] = values
        else:
            row[index] = values
        self._rows.append(row)

    def result(self, default: np.ndarray) -> np.ndarray:
        """The robust mean per coordinate; `default` where nobody sent the coordinate."""
        out = np.asarray(default, dtype=np.float64).copy()
        if not self._rows:
            return out
        table = np.sort(np.stack(self._rows), axis=0)  # NaN (not sent) sorts last
        sent = (~np.isnan(table)).sum(axis=0)
        rank = np.arange(table.shape[0])[:, None]
        if self.mode == "median":
            lo, hi = (sent - 1) // 2, sent // 2  # the middle one, or the middle two averaged
            keep = (rank == lo) | (rank == hi)
        else:
            cut = np.floor(self.trim * sent).astype(np.int64)
            keep = (rank >= cut) & (rank < sent - cut)
        keep &= sent > 0
        n = keep.sum(axis=0)
        total = np.where(keep, np.nan_to_num(table), 0.0).sum(axis=0)
        has = n > 0
        out[has] = total[has] / n[has]
        return out
