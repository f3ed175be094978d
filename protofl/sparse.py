"""A sparse vector: the shape a top-K parameter upload takes, shared by the algorithms and the codec."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SparseVector:
    """`n` is the dense length; `indices` are sorted, unique int64 in [0, n); `values` align with them."""

    n: int
    indices: np.ndarray
    values: np.ndarray

    def __post_init__(self) -> None:
        if self.indices.shape != self.values.shape or self.indices.ndim != 1:
            raise ValueError(
                f"sparse vector: indices {self.indices.shape} and values {self.values.shape} must be equal 1-D shapes"
            )

    @property
    def nnz(self) -> int:
        return int(self.indices.shape[0])

    def to_dense(self, fill: float = 0.0) -> np.ndarray:
        out = np.full(self.n, fill, dtype=np.float32)
        out[self.indices] = self.values
        return out
