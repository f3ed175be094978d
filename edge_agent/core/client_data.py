"""A device's private data as the agent holds it, and the seeds derived from names: numpy only, so that a lite
device (no torch: edge_agent/ops/lite.py) loads its data with the same code as a torch device."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from protofl.data.dataset import Images

__all__ = ["ClientData", "stable_seed"]


@dataclass
class ClientData:
    """A client's private data, normalised float32 (n, c, h, w) or uint8 `Images` normalised per batch (how `join`
    holds it: a quarter of the bytes), plus evaluation splits.

    `x_global`/`y_global` (the official test set) exist only in simulation, for global and
    ensemble accuracy; a field device reports accuracy on its own held-out split only.
    """

    x_train: np.ndarray | Images
    y_train: np.ndarray
    x_test: np.ndarray | Images
    y_test: np.ndarray
    x_global: np.ndarray | Images | None = None
    y_global: np.ndarray | None = None
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)
    skipped_files: int = 0  # files of its `--data` the loader skipped (unreadable): reported in Metrics.extra

    def __post_init__(self) -> None:
        if len(self.x_train) != len(self.y_train) or len(self.x_test) != len(self.y_test):
            raise ValueError("client data: x and y lengths differ")
        if len(self.x_train) == 0:
            raise ValueError("client data: no training samples")


def stable_seed(*parts: object) -> int:
    """A seed from strings/ints that is the same in every process (unlike hash())."""
    return zlib.crc32("/".join(str(p) for p in parts).encode()) & 0x7FFFFFFF
