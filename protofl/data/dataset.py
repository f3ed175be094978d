"""The ``Dataset`` container: uint8 images, labels and their normalisation (numpy only).

Images are kept as uint8 (n, c, h, w) -- 4x smaller than float32, which matters when a simulator holds
20 clients' data in one process -- and normalised on demand with :meth:`Dataset.normalized`. The
loaders (``protofl.data.loaders``) and the synthetic generator (``protofl.data.synthetic``) both build
on this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from protofl.errors import DataError

__all__ = ["Dataset", "Images", "channel_stats", "normalize_uint8"]


@dataclass
class Dataset:
    """Images ``x`` uint8 (n, c, h, w), labels ``y`` int64 (n,), and per-channel mean/std in [0, 1] units."""

    x: np.ndarray
    y: np.ndarray
    num_classes: int
    name: str
    mean: tuple[float, ...]
    std: tuple[float, ...]
    skipped_files: int = 0  # files its loader skipped (an image folder's unreadable or non-image files)

    def __post_init__(self) -> None:
        if self.x.dtype != np.uint8 or self.x.ndim != 4:
            raise DataError(f"dataset {self.name!r}: x must be uint8 (n, c, h, w), got {self.x.dtype} {self.x.shape}")
        if self.y.ndim != 1 or len(self.y) != len(self.x):
            raise DataError(
                f"dataset {self.name!r}: y must be 1-D with one label per image, got {self.y.shape} "
                f"for {len(self.x)} images"
            )
        if not np.issubdtype(self.y.dtype, np.integer):
            raise DataError(f"dataset {self.name!r}: labels must be integers, got {self.y.dtype}")
        if self.y.dtype != np.int64:
            self.y = self.y.astype(np.int64)
        c = self.x.shape[1]
        self.mean = tuple(float(v) for v in self.mean)
        self.std = tuple(float(v) for v in self.std)
        if len(self.mean) != c or len(self.std) != c:
            raise DataError(
                f"dataset {self.name!r}: mean/std need one value per channel ({c}), "
                f"got {len(self.mean)}/{len(self.std)}"
            )
        if min(self.std) <= 0:
            raise DataError(f"dataset {self.name!r}: std must be positive, got {self.std}")

    def __len__(self) -> int:
        return int(self.x.shape[0])

    @property
    def in_shape(self) -> tuple[int, int, int]:
        """(c, h, w) of one image: what ``build_model`` takes."""
        _, c, h, w = self.x.shape
        return (int(c), int(h), int(w))

    def subset(self, indices: np.ndarray | Sequence[int]) -> Dataset:
        """The samples at ``indices`` (copied), with the same classes and normalisation."""
        idx = np.asarray(indices, dtype=np.int64)
        return Dataset(self.x[idx], self.y[idx], self.num_classes, self.name, self.mean, self.std)

    def normalized(
        self,
        indices: np.ndarray | Sequence[int] | None = None,
        *,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
    ) -> np.ndarray:
        """float32 (x / 255 - mean) / std, for all samples or only ``indices``.

        ``mean``/``std`` default to the dataset's own; pass a model's (from its ONNX metadata) to feed
        the model what it was trained on.
        """
        x = self.x if indices is None else self.x[np.asarray(indices, dtype=np.int64)]
        c = x.shape[1]
        mean = self.mean if mean is None else tuple(mean)
        std = self.std if std is None else tuple(std)
        if len(mean) != c or len(std) != c:
            raise DataError(f"normalisation has {len(mean)}/{len(std)} mean/std values for {c}-channel images")
        return normalize_uint8(x, mean, std)

    def class_counts(self) -> np.ndarray:
        """Samples per class, length ``num_classes``."""
        return np.bincount(self.y, minlength=self.num_classes)


def normalize_uint8(x: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """float32 (x / 255 - mean) / std of uint8 (n, c, h, w) images: every row the same values whether normalised
    alone, in a batch or with the whole set (elementwise float32 operations, in this order)."""
    c = x.shape[1]
    m = np.asarray(mean, dtype=np.float32).reshape(1, c, 1, 1)
    s = np.asarray(std, dtype=np.float32).reshape(1, c, 1, 1)
    out = x.astype(np.float32)
    out *= np.float32(1.0 / 255.0)
    out -= m
    out /= s
    return out


def channel_stats(x: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std of uint8 images in [0, 1] units (std floored: constant images)."""
    c = x.shape[1]
    flat = np.moveaxis(x, 1, 0).reshape(c, -1)
    mean = flat.mean(axis=1, dtype=np.float64) / 255.0
    std = flat.std(axis=1, dtype=np.float64) / 255.0
    return tuple(float(m) for m in mean), tuple(float(max(s, 1e-3)) for s in std)


class Images:
    """Images held as uint8 (n, c, h, w) and normalised a batch at a time: `images[idx]` is the float32 rows
    `Dataset.normalized` would give, bit for bit, without a normalised copy of the whole set (4x the bytes).
    A device keeps its data so (bench/results/FOOTPRINT.md); `np.asarray(images)` normalises all at once."""

    def __init__(self, x: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> None:
        if x.dtype != np.uint8 or x.ndim != 4:
            raise DataError(f"Images: x must be uint8 (n, c, h, w), got {x.dtype} {x.shape}")
        if len(mean) != x.shape[1] or len(std) != x.shape[1]:
            raise DataError(f"Images: {len(mean)}/{len(std)} mean/std values for {x.shape[1]}-channel images")
        self.raw = x
        self.mean = tuple(float(v) for v in mean)
        self.std = tuple(float(v) for v in std)

    @classmethod
    def of(cls, data: Dataset, indices: np.ndarray | Sequence[int] | None = None) -> Images:
        """`data`'s samples at `indices` (copied; all of them without), with its normalisation."""
        x = data.x if indices is None else data.x[np.asarray(indices, dtype=np.int64)]
        return cls(x, data.mean, data.std)

    def __len__(self) -> int:
        return int(self.raw.shape[0])

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(v) for v in self.raw.shape)

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    def __getitem__(self, idx: slice | np.ndarray | Sequence[int]) -> np.ndarray:
        rows = self.raw[idx] if isinstance(idx, slice) else self.raw[np.asarray(idx, dtype=np.int64)]
        return normalize_uint8(rows, self.mean, self.std)

    def __array__(self, dtype: np.dtype | None = None, copy: bool | None = None) -> np.ndarray:
        out = normalize_uint8(self.raw, self.mean, self.std)
        return out if dtype is None else out.astype(dtype, copy=False)
