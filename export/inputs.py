"""Real input images for verify / quantize / bench / predict: a dataset spec -> normalised float32 arrays."""

from __future__ import annotations

import numpy as np

from protofl.data import Dataset, load_dataset
from protofl.errors import DataError

__all__ = ["load_images", "normalise"]


def normalise(x: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """uint8 (n, c, h, w) -> float32 (x / 255 - mean) / std, per channel."""
    c = x.shape[1]
    if len(mean) != c or len(std) != c:
        raise DataError(f"normalisation has {len(mean)}/{len(std)} mean/std values for {c}-channel images")
    m = np.asarray(mean, dtype=np.float32).reshape(1, c, 1, 1)
    s = np.asarray(std, dtype=np.float32).reshape(1, c, 1, 1)
    return ((x.astype(np.float32) / np.float32(255.0)) - m) / s


def load_images(spec: str, split: str = "test", n: int | None = None, *, in_shape: tuple[int, ...] | None = None,
                mean: tuple[float, ...] | None = None, std: tuple[float, ...] | None = None,
                seed: int = 0) -> tuple[np.ndarray, np.ndarray, Dataset]:
    """(x normalised float32, y, dataset) for ``split`` ("train" | "test") of a dataset spec.

    ``n`` keeps a seeded random subset (all classes represented in expectation, unlike the first n).
    ``mean``/``std`` default to the dataset's own; pass the model's (from its ONNX metadata) when known.
    ``in_shape`` (c, h, w) is checked so that a wrong dataset fails with both shapes named.
    """
    if split not in ("train", "test"):
        raise DataError(f"split must be 'train' or 'test', got {split!r}")
    train, test = load_dataset(spec, seed=seed)  # raises DataError naming the missing path and the specs
    ds = train if split == "train" else test
    if in_shape is not None and tuple(ds.in_shape) != tuple(in_shape):
        raise DataError(f"dataset {spec!r} has images of shape {ds.in_shape} but the model takes {tuple(in_shape)}; "
                        "pass data of the model's input shape")
    idx = np.arange(len(ds))
    if n is not None and n < len(ds):
        idx = np.sort(np.random.default_rng([seed, 0xDA7A]).permutation(len(ds))[:n])
    x = normalise(ds.x[idx], tuple(mean) if mean else ds.mean, tuple(std) if std else ds.std)
    return x, ds.y[idx], ds
