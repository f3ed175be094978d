"""Per-class supports: prototypes that live on a subset of the m dims, one mask row per class (numpy).

A technique that gives each class a support mask (docs/algorithms.md, "Class-wise sparsification") sends
only the values on it; every other rule reads and writes prototypes through these functions, so none of
them needs to know which technique chose the masks. Without masks a table is dense and these are not
called.

    structured sparse vector   c~ = c * m_c                     (zeros off the mask)
    compressed vector          c^ = (c_i : m_c,i = 1)           (s values, ascending dims, no indices)
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

__all__ = [
    "compress",
    "reconstruct",
    "compress_table",
    "reconstruct_table",
    "restrict_to_masks",
    "off_mask_energy",
    "as_masks",
]


def compress(p: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Eq. (8): the s values of `p` (m,) where `mask` is set, in ascending dim order, as float32."""
    p = np.asarray(p)
    mask = np.asarray(mask)
    if mask.dtype != bool or mask.ndim != 1 or p.shape != mask.shape:
        raise ValueError(
            f"support compress: need p (m,) and a bool mask (m,), got {p.shape} and {mask.dtype} {mask.shape}"
        )
    return p[mask].astype(np.float32)


def reconstruct(values: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Eq. (7) from eq. (8): scatter the s values back onto the mask, zeros elsewhere, float32."""
    values = np.asarray(values)
    mask = np.asarray(mask)
    if mask.dtype != bool or mask.ndim != 1:
        raise ValueError(f"support reconstruct: mask must be a 1-D bool array, got {mask.dtype} {mask.shape}")
    s = int(mask.sum())
    if values.shape != (s,):
        raise ValueError(f"support reconstruct: expected {s} values for this class's mask, got shape {values.shape}")
    out = np.zeros(mask.shape[0], dtype=np.float32)
    out[mask] = values
    return out


def compress_table(protos: Mapping[int, np.ndarray], masks: np.ndarray) -> dict[int, np.ndarray]:
    """compress() for every class in the table, each with its own mask row."""
    masks = as_masks(masks)
    return {c: compress(p, masks[_row(c, masks)]) for c, p in _items(protos)}


def reconstruct_table(values: Mapping[int, np.ndarray], masks: np.ndarray) -> dict[int, np.ndarray]:
    """reconstruct() for every class in the table."""
    masks = as_masks(masks)
    return {c: reconstruct(v, masks[_row(c, masks)]) for c, v in _items(values)}


def restrict_to_masks(P: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """Each row of unit prototypes P (C, m) cut to its class's mask and renormalised, so that it is a unit
    vector living on the mask's s dims (docs/algorithms.md, the combined pipeline's candidate (b)).

    A row that is zero on its support has no direction there; it becomes the normalised mask itself
    (every support dim equal), a valid unit vector rather than a division by zero. Returns float32.
    """
    m = as_masks(masks)
    P = np.asarray(P, dtype=np.float64)
    if P.shape != m.shape:
        raise ValueError(f"support: prototypes of shape {P.shape} for masks of shape {m.shape}")
    cut = np.where(m, P, 0.0)
    length = np.linalg.norm(cut, axis=1, keepdims=True)
    fallback = m / np.sqrt(np.maximum(m.sum(axis=1, keepdims=True), 1))
    return np.where(length > 0, cut / np.where(length > 0, length, 1.0), fallback).astype(np.float32)


def off_mask_energy(z: np.ndarray, y: np.ndarray, masks: np.ndarray) -> float:
    """Fraction of the features' energy outside their class's mask: sum_i ||z_i * (1 - m_{y_i})||^2 /
    sum_i ||z_i||^2 (0 for z = 0).

    A masked alignment target is zero off the mask, so this is how far training has made z structured-sparse
    (docs/algorithms.md: most of the alignment error is off-mask shrinkage; the benchmark reports it).
    """
    z = np.asarray(z, dtype=np.float64)
    off = ~as_masks(masks)[np.asarray(y, dtype=np.int64)]
    total = float(np.square(z).sum())
    return float(np.square(z[off]).sum()) / total if total > 0 else 0.0


def as_masks(masks: np.ndarray) -> np.ndarray:
    masks = np.asarray(masks)
    if masks.ndim != 2 or masks.dtype != bool:
        raise ValueError(f"support: masks must be a (C, m) bool array, got {masks.dtype} {masks.shape}")
    return masks


def _row(c: int, masks: np.ndarray) -> int:
    if not 0 <= c < masks.shape[0]:
        raise ValueError(f"support: class id {c} has no mask (masks cover classes 0..{masks.shape[0] - 1})")
    return c


def _items(table: Mapping[int, np.ndarray]) -> list[tuple[int, np.ndarray]]:
    out = []
    for c, v in table.items():
        if isinstance(c, bool) or not isinstance(c, (int, np.integer)):
            raise ValueError(f"support: class id must be an integer, got {c!r}")
        out.append((int(c), v))
    return out
