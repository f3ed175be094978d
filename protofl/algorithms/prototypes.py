"""Class prototypes, the concept every prototype method shares (numpy only): a device's per-class means of its
features (`local_prototypes`) and classification by the nearest prototype (`nearest_prototype`).

Every prototype technique, the device's metrics, its deployable artifacts, `predict` and the export tool use
them, so they live here, in no technique's module (the import contract "technique-homes" in pyproject.toml keeps
the generic modules from importing a technique's).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

__all__ = ["local_prototypes", "nearest_prototype"]


def local_prototypes(z: np.ndarray, y: np.ndarray, num_classes: int) -> tuple[dict[int, np.ndarray], dict[int, int]]:
    """Per-class mean of the rows of `z` (n, m) grouped by label `y` (n,), and the class counts.

    Only classes present in `y` appear in either dict: an absent class has no mean, and sending a
    zero vector for it would drag the global prototype towards the origin.
    """
    z = np.asarray(z)
    y = np.asarray(y)
    if z.ndim != 2 or y.ndim != 1 or z.shape[0] != y.shape[0]:
        raise ValueError(f"local prototypes: need z of shape (n, m) and y of shape (n,), got {z.shape} and {y.shape}")
    if y.size and not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"local prototypes: labels must be integers, got dtype {y.dtype}")
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(f"local prototypes: labels must lie in [0, {num_classes}), got range [{y.min()}, {y.max()}]")
    z64 = z.astype(np.float64, copy=False)
    if not np.isfinite(z64).all():
        raise ValueError("local prototypes: features contain NaN or inf; the model has diverged")
    counts = np.bincount(y, minlength=num_classes) if y.size else np.zeros(num_classes, dtype=np.int64)
    sums = np.zeros((num_classes, z.shape[1]), dtype=np.float64)
    np.add.at(sums, y, z64)
    present = np.flatnonzero(counts)
    protos = {int(c): (sums[c] / counts[c]).astype(np.float32) for c in present}
    return protos, {int(c): int(counts[c]) for c in present}


def nearest_prototype(z: np.ndarray, protos: Mapping[int, np.ndarray]) -> np.ndarray:
    """Class id of the prototype nearest (L2) to each row of `z` (n, m); ties go to the lower class id."""
    z = np.asarray(z)
    if z.ndim != 2:
        raise ValueError(f"nearest prototype: z must have shape (n, m), got {z.shape}")
    if not protos:
        raise ValueError("nearest prototype: the prototype table is empty; there is nothing to classify against")
    classes = np.array(sorted(int(c) for c in protos), dtype=np.int64)
    table = np.stack([np.asarray(protos[int(c)], dtype=np.float64) for c in classes])
    if table.shape[1] != z.shape[1]:
        raise ValueError(f"nearest prototype: features have {z.shape[1]} dims, prototypes {table.shape[1]}")
    z64 = z.astype(np.float64, copy=False)
    # ||z||^2 is the same for every class, so it cannot change the argmin and is left out; this
    # keeps memory at n x C instead of the n x C x m of a broadcast difference.
    d2 = (table * table).sum(axis=1)[None, :] - 2.0 * (z64 @ table.T)
    # argmin returns the first minimum and `classes` is ascending: ties go to the lower class id.
    return classes[np.argmin(d2, axis=1)] if z.shape[0] else np.zeros(0, dtype=np.int64)
