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


def row_dots(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(k,) float64: np.dot(a[i], b[i]) for every row of two (k, w) float64 arrays, bit for bit.

    A stack of (1, w) @ (w, 1) products goes through the same dot kernel as np.dot on one row, so a norm or
    distance taken for many rows at once equals the one `clip_around` takes row by row (einsum and
    sum(axis=1) add in other orders and differ in the last bits); about 3x faster than the loop at 10 rows."""
    return (a[:, None, :] @ b[:, :, None]).reshape(a.shape[0])


def class_rows(classes: np.ndarray) -> slice | np.ndarray:
    """How to index the rows of a per-class table for `classes` (unique, ascending, as a decoded ProtoSet's):
    a slice when they are consecutive (a device that holds every class), which numpy reads as a view and adds
    into in place, where a list of classes costs a gather (and a scatter for +=); else the classes."""
    k = classes.shape[0]
    if k and int(classes[-1]) - int(classes[0]) == k - 1:
        return slice(int(classes[0]), int(classes[0]) + k)
    return classes


def center_table(table: Mapping[int, np.ndarray], num_classes: int, width: int) -> np.ndarray:
    """(num_classes, width) float64: row c the centre `table[c]`, zeros for a class without one. A phase builds
    it once (the centres change only when it ends) and clips every prototype row around its class's row."""
    out = np.zeros((num_classes, width))
    for c, v in table.items():
        out[c] = v
    return out


def clip_rows(rows: np.ndarray, centers: np.ndarray, radius: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`clip_around` for every row of `rows` (k, w) around the same row of `centers` (k, w, float64), in one
    pass: (the clipped rows in float64, their distances ||u - c|| before clipping, their norms ||u|| as sent:
    what `NormLog.record_rows` keeps). Equal to the per-row versions bit for bit: a row within the radius is
    itself, a row beyond it c + d * (radius / ||d||)."""
    u64 = np.asarray(rows, dtype=np.float64)
    k = u64.shape[0]
    both = np.empty((2 * k, u64.shape[1]))  # d = u - c and u: one batched product gives distances and norms
    np.subtract(u64, centers, out=both[:k])
    both[k:] = u64
    lengths = np.sqrt(row_dots(both, both))
    d, dist, norm = both[:k], lengths[:k], lengths[k:]
    over = dist > radius
    if not np.count_nonzero(over):  # (not .any(): numpy's generic reduction costs ~2 us more a call)
        return u64, dist, norm
    out = u64.copy()
    out[over] = centers[over] + d[over] * (radius / dist[over])[:, None]
    return out, dist, norm


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
        return (
            f"radius = {self.factor:g} x the median norm of the previous round's accepted uploads of that "
            f"kind; {self.first_radius:g} before any"
        )


class NormLog:
    """The norms ||u|| of one round's accepted uploads (for the next radius) and how many were clipped."""

    def __init__(self) -> None:
        self.values: list[float] = []
        self.clipped = 0

    def record(self, u: np.ndarray, dist: float, radius: float) -> None:
        u = np.asarray(u, dtype=np.float64)
        self.values.append(float(np.sqrt(np.dot(u, u))))
        self.clipped += dist > radius

    def record_rows(self, norms: np.ndarray, dists: np.ndarray, radius: float) -> None:
        """`record` for k rows at once: their norms as sent and their distances (what `clip_rows` returns)."""
        self.values.extend(norms.tolist())
        self.clipped += int(np.count_nonzero(dists > radius))


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
