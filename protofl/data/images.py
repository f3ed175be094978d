"""Real input images for the ONNX tools and the device's ``predict``: a dataset spec -> normalised float32.

numpy only: the device (``protofl-edge predict``) and the export tool (``protofl-export verify /
quantize / bench``) both read their images through here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from protofl.data.dataset import Dataset
from protofl.data.loaders import load_dataset
from protofl.errors import DataError

__all__ = ["load_images"]


def load_images(
    spec: str,
    split: str = "test",
    n: int | None = None,
    *,
    in_shape: tuple[int, ...] | None = None,
    mean: tuple[float, ...] | None = None,
    std: tuple[float, ...] | None = None,
    seed: int = 0,
    class_names: Sequence[str] | None = None,
) -> tuple[np.ndarray, np.ndarray, Dataset]:
    """(x normalised float32, y, dataset) for ``split`` ("train" | "test") of a dataset spec.

    ``n`` keeps a seeded random subset (all classes represented in expectation, unlike the first n).
    ``mean``/``std`` default to the dataset's own; pass the model's (from its ONNX metadata) when known.
    ``in_shape`` (c, h, w) is checked so that a wrong dataset fails with both shapes named. ``class_names`` (the
    model's, indexed by class id): class folders and a CSV's label names are labelled by them, not by their order.
    """
    if split not in ("train", "test"):
        raise DataError(f"split must be 'train' or 'test', got {split!r}")
    # raises DataError naming the missing path and the specs
    train, test = load_dataset(spec, seed=seed, class_names=class_names)
    ds = train if split == "train" else test
    if in_shape is not None and tuple(ds.in_shape) != tuple(in_shape):
        raise DataError(
            f"dataset {spec!r} has images of shape {ds.in_shape} but the model takes {tuple(in_shape)}; "
            "pass data of the model's input shape"
        )
    idx = np.arange(len(ds))
    if n is not None and n < len(ds):
        idx = np.sort(np.random.default_rng([seed, 0xDA7A]).permutation(len(ds))[:n])
    return ds.normalized(idx, mean=mean or None, std=std or None), ds.y[idx], ds
