"""Unit prototypes on the sphere: the client mean (eq. 2) and the server consensus (eq. 3) (numpy).

    p_kc     = Normalize(mean of z_hat over D_kc), z_hat = z / ||z||               (client, eq. 2)
    p_bar_c  = Normalize((1 / |K_c|) sum_{k in K_c} p_kc) over the senders K_c   (server, eq. 3)

a class nobody sent keeps last round's prototype; round 0 uses seeded random unit vectors. The public-set
anchors on the sphere use them as well as the technique that introduced them (docs/algorithms.md).
"""
# Eqs. (2)-(3) and Alg. 1 line 1 of FedPAGR (paper 004).

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from protofl.algorithms.prototypes import local_prototypes
from protofl.algorithms.robust import row_dots
from protofl.algorithms.support import compress_table
from protofl.mergeable import Additive
from protofl.technique import BatchedFold, Clip, ClippedSet, ClippedUpload, Part, Upload

__all__ = [
    "normalize_rows",
    "client_prototypes",
    "initial_prototypes",
    "on_wire",
    "wire_centers",
    "ConsensusAggregator",
    "UnitFold",
]


def normalize_rows(x: np.ndarray, eps: float = 1e-12) -> np.ndarray:
    """x / ||x|| along the last axis (a 1-D x is one row); norms below eps are treated as eps.

    Floating dtypes are kept (float32 in, float32 out), anything else becomes float64.
    """
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.floating):
        x = x.astype(np.float64)
    norms = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.maximum(norms, eps)


def client_prototypes(z: np.ndarray, y: np.ndarray, num_classes: int) -> dict[int, np.ndarray]:
    """Eq. (2): per class this client holds, the normalised mean of its normalised features."""
    protos, _ = local_prototypes(normalize_rows(z), y, num_classes)
    return {c: normalize_rows(p[None])[0] for c, p in protos.items()}


def initial_prototypes(num_classes: int, dim: int, seed: int) -> np.ndarray:
    """Round-0 prototypes: (C, m) float32 rows drawn uniformly on the unit sphere (normalised Gaussians)."""
    if int(num_classes) < 1 or int(dim) < 1:
        raise ValueError(f"unit prototypes: need num_classes >= 1 and dim >= 1, got {num_classes}, {dim}")
    rng = np.random.default_rng(seed)
    return normalize_rows(rng.standard_normal((int(num_classes), int(dim)))).astype(np.float32)


def on_wire(unit: np.ndarray, masks: np.ndarray | None) -> dict[int, np.ndarray]:
    """The unit prototypes as they travel: every class, cut to its support mask where there are masks."""
    table = dict(enumerate(unit))
    return compress_table(table, masks) if masks is not None else table


def wire_centers(unit: np.ndarray, masks: np.ndarray | None) -> np.ndarray:
    """(C, width) float64: the unit prototypes as they travel (each cut to its support, s values in ascending
    dims, where there are masks), the centres unit uploads are clipped around; a phase takes them once."""
    if masks is None:
        return unit.astype(np.float64)
    return unit[masks].reshape(unit.shape[0], -1).astype(np.float64)


class ConsensusAggregator(Additive):
    """Eq. (3) as a stream: per-class sum S_c and sender count K_c of unit client prototypes."""

    additive = ("_sum", "_count", "_senders")  # mergeable across aggregator shards

    def __init__(self, previous: np.ndarray) -> None:
        prev = np.asarray(previous)
        if prev.ndim != 2 or prev.shape[0] < 1 or prev.shape[1] < 1:
            raise ValueError(f"consensus: previous prototypes must be a (C, m) array, got shape {prev.shape}")
        prev = prev.astype(np.float64)
        if not np.isfinite(prev).all():
            raise ValueError("consensus: previous prototypes contain NaN or inf")
        self._previous = prev
        self.num_classes, self.dim = prev.shape
        self._sum = np.zeros_like(prev)
        self._count = np.zeros(self.num_classes, dtype=np.int64)
        self._senders = 0

    @property
    def senders(self) -> int:
        """How many uploads have been accepted."""
        return self._senders

    def add(self, protos: Mapping[int, np.ndarray]) -> None:
        """Fold in one client's unit prototypes; checked in full before anything is applied."""
        self.fold(self.check(protos))

    def fold(self, rows: list[tuple[int, np.ndarray]]) -> None:
        """Fold in rows that `check` returned (one upload)."""
        for c, v in rows:
            self._sum[c] += v
            self._count[c] += 1
        self._senders += 1

    def check(self, protos: Mapping[int, np.ndarray]) -> list[tuple[int, np.ndarray]]:
        """The upload's (class, unit row) pairs; raises ValueError, changing nothing, if any is invalid."""
        rows = []
        for c, p in protos.items():
            if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or not 0 <= int(c) < self.num_classes:
                raise ValueError(f"consensus: class id {c!r} is not an integer in [0, {self.num_classes})")
            v = np.asarray(p)
            if v.shape != (self.dim,):
                raise ValueError(f"consensus: prototype for class {c}: expected shape ({self.dim},), got {v.shape}")
            v = v.astype(np.float64)
            if not np.isfinite(v).all():
                raise ValueError(f"consensus: prototype for class {c} contains NaN or inf; drop this upload")
            length = float(np.linalg.norm(v))
            if length == 0.0:
                raise ValueError(f"consensus: prototype for class {c} is the zero vector; it has no direction")
            # Eq. (2) makes p_kc a unit vector; normalising again keeps a client that skipped that
            # step (or a lossy codec) from outweighing the others.
            rows.append((int(c), v / length))
        return rows

    def check_rows(self, classes: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """`check` for one upload as rows (k, width) of a decoded ProtoSet (classes unique and ascending, rows
        finite: the decoder checked them): each row normalised to a unit vector, in one pass; raises
        ValueError, changing nothing, for a class out of range or a zero row. `width` is m, or s where the
        rows are cut to their classes' supports (`fold_many` puts them back in place)."""
        if classes.size and not 0 <= int(classes[0]) <= int(classes[-1]) < self.num_classes:
            raise ValueError(f"consensus: class ids must lie in [0, {self.num_classes})")
        rows = np.asarray(rows, dtype=np.float64)
        length = np.sqrt(row_dots(rows, rows))
        if np.count_nonzero(length == 0.0):  # (not .any(): see robust.clip_rows)
            c = int(classes[np.flatnonzero(length == 0.0)[0]])
            raise ValueError(f"consensus: prototype for class {c} is the zero vector; it has no direction")
        return rows / length[:, None]

    def fold_many(self, classes: list[np.ndarray], units: np.ndarray, support: np.ndarray | None, uploads: int) -> None:
        """Fold in the rows `check_rows` returned, for several uploads: `classes` one array per upload with rows,
        in arrival order, `units` their rows concatenated in that order, `uploads` the senders (uploads with no
        rows included). With `support` (C, s), the dims of each class's mask in ascending order, a row of s
        values goes onto its class's support only: the sums of scattering it to full width first, without
        building the (C, m) rows. Every value goes to its place in the flat sums through one `np.add.at`,
        which adds in index order: the sums of `fold` upload by upload."""
        if classes:
            every = np.concatenate(classes)
            dims = np.arange(self.dim) if support is None else support[every]
            np.add.at(self._sum.reshape(-1), (every[:, None] * self.dim + dims).reshape(-1), units.reshape(-1))
            np.add.at(self._count, every, 1)
        self._senders += uploads

    def sums(self) -> tuple[np.ndarray, np.ndarray]:
        """(S, K): per-class sums of unit prototypes (C, m) float64 and sender counts (C,) int64, copies."""
        return self._sum.copy(), self._count.copy()

    def result(self) -> np.ndarray:
        """p_bar (C, m) float32: Normalize(S_c / K_c) where K_c > 0, else last round's row.

        A class whose submissions cancel exactly (S_c = 0) has no mean direction and also keeps
        last round's row.
        """
        out = self._previous.copy()
        length = np.linalg.norm(self._sum, axis=1)
        ok = (self._count > 0) & (length > 0)
        # Dividing by K_c does not change the direction, so normalising S_c is enough.
        out[ok] = self._sum[ok] / length[ok, None]
        return out.astype(np.float32)


class UnitFold(BatchedFold):
    """Unit prototypes of a training upload folded into eq. (3)'s sums around `unit` (C, m), the current ones
    on their `masks`' supports where there are masks; `part` says which of the upload's sets (`prototypes` reads
    it, and may check more).

    Where there are masks the rows travel cut to their supports (s of m values) and stay so: clipped around
    the current prototypes cut the same way, normalised, and added onto their supports in the (C, m) sums.
    Each upload is normalised when it is checked (a row clipped to zero refuses it); the sums take a batch at a
    time (BatchedFold)."""

    kinds = (Upload.PROTOS,)
    merged = ("acc",)
    part = Part.LOCAL

    def __init__(self, unit: np.ndarray, masks: np.ndarray | None) -> None:
        super().__init__()
        self.acc = ConsensusAggregator(unit)
        self.centers = wire_centers(unit, masks)  # the unit prototypes change only when the phase ends
        self.clip = {self.part: Clip("protos", self.centers)}
        self.support = None if masks is None else np.nonzero(masks)[1].reshape(masks.shape[0], -1)

    def prototypes(self, up: ClippedUpload) -> ClippedSet | None:
        return up.local if self.part is Part.LOCAL else up.public

    def check(self, up: ClippedUpload) -> Any:
        ps = self.prototypes(up)
        if ps is None or not ps.classes.size:
            return None
        width = self.centers.shape[1]  # m, or s where rows travel cut to their supports
        if ps.shape[1] != width:
            raise ValueError(f"consensus: expected {width} values per class, got {ps.shape[1]}")
        rows = ps.rows  # clipped by the phase (this upload's alone: the check needs them)
        if self.support is not None:
            rows = rows.astype(np.float32)  # a clipped row goes on at float32, as scattering it to width m did
        return ps.classes, self.acc.check_rows(ps.classes, rows)

    def elements(self, prepared: Any) -> int:
        return 0 if prepared is None else int(prepared[1].size)

    def fold_batch(self, batch: list[Any]) -> None:
        sent = [p for p in batch if p is not None]
        units = np.concatenate([p[1] for p in sent]) if sent else np.zeros((0, self.acc.dim))
        self.acc.fold_many([p[0] for p in sent], units, self.support, len(batch))
