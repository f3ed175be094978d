"""FedAvg (McMahan et al., 2017): the sample-weighted mean of full parameter vectors.

The baseline every comparison needs (ALGORITHMS.md, "Baselines"): each client uploads its whole
flattened parameter vector theta_k with weight |D_k|, and the server computes

    theta^{t+1} = sum_k |D_k| theta_k / sum_k |D_k|,

which is also eq. (2) of RefProtoFL (paper 000) read as an aggregation rule. There is no client
half beyond flattening the model (done by the agent); the server half is a streaming accumulator
that holds one running sum, so memory does not grow with the number of uploads.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["FedAvgAggregator"]


class FedAvgAggregator:
    """Running sample-weighted mean of dense vectors of length `dim`."""

    def __init__(self, dim: int) -> None:
        if int(dim) < 1:
            raise ValueError(f"FedAvg: dim must be >= 1, got {dim}")
        self._dim = int(dim)
        self._num = np.zeros(self._dim, dtype=np.float64)
        self._den = 0.0
        self._count = 0

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def senders(self) -> int:
        """How many uploads have been accepted."""
        return self._count

    def add(self, vector: np.ndarray, weight: float) -> None:
        """Fold in one client's vector with weight |D_k|; a rejected upload leaves the state unchanged."""
        w = float(weight)
        if not math.isfinite(w) or w <= 0.0:
            raise ValueError(f"FedAvg: weight must be a finite number > 0 (the client's |D_k|), got {weight!r}")
        v = np.asarray(vector)
        if v.shape != (self._dim,):
            # A wrong length almost always means the client flattened a different architecture.
            raise ValueError(
                f"FedAvg: expected shape ({self._dim},), got {v.shape}; is the client running the same model?"
            )
        # float64 before multiplying: w * float32 would round the product to float32 first.
        v64 = v.astype(np.float64, copy=False)
        if not np.isfinite(v64).all():
            raise ValueError("FedAvg: vector contains NaN or inf; drop this upload")
        self._num += w * v64
        self._den += w
        self._count += 1

    def result(self) -> np.ndarray:
        """The weighted mean as float32; raises if nothing was added (there is no mean to take)."""
        if self._count == 0:
            raise ValueError("FedAvg: no uploads were added; keep the previous global model instead")
        return (self._num / self._den).astype(np.float32)
