"""CPS, class-wise prototype sparsification: TinyProto (Lee et al., paper 002), Sec. 4.1.2.

One binary mask m_c in {0,1}^m per class, with exactly s ones, shared by server and clients.

    structured sparse prototype   c~ = S(c; m_c) = c * m_c            (eq. 7, zeros off the mask)
    compressed prototype          c^ = C(c; m_c) = (c_i : m_c,i = 1)   (eq. 8, s values, no indices)

Masks: the paper only says "we typically maximize pairwise Hamming distances between the masking
vectors". Ours (ALGORITHMS.md, "TinyProto"): if C * s <= m the supports are disjoint, cut from one
seeded permutation, so every pair is at the largest possible distance 2s. Otherwise a seeded
greedy: for each class in turn draw `candidates` random s-subsets and keep the one whose minimum
Hamming distance to the masks already chosen is largest (first candidate on ties).

Server side there is no state: the server aggregates compressed vectors class by class (fedproto
or scaling accumulators with dim = s) and ships the masks once, packed to bits.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

__all__ = [
    "make_masks",
    "min_pairwise_hamming",
    "compress",
    "reconstruct",
    "compress_table",
    "reconstruct_table",
    "pack_masks",
    "unpack_masks",
    "off_mask_energy",
    "restrict_to_masks",
]


def make_masks(num_classes: int, m: int, s: int, seed: int = 0, candidates: int = 64) -> np.ndarray:
    """(C, m) bool masks with exactly s ones per row; deterministic given `seed`."""
    C, m, s = int(num_classes), int(m), int(s)
    if C < 1:
        raise ValueError(f"CPS: num_classes must be >= 1, got {num_classes}")
    if not 1 <= s <= m:
        raise ValueError(f"CPS: need 1 <= s <= m, got s={s}, m={m}")
    if int(candidates) < 1:
        raise ValueError(f"CPS: candidates must be >= 1, got {candidates}")
    rng = np.random.default_rng(seed)
    masks = np.zeros((C, m), dtype=bool)
    if C * s <= m:
        perm = rng.permutation(m)
        masks[np.repeat(np.arange(C), s), perm[: C * s]] = True
        return masks
    # float32 so the overlap counts go through BLAS; they are integers <= m, exact in float32.
    chosen = np.zeros((C, m), dtype=np.float32)
    for c in range(C):
        # argpartition of uniform keys gives a uniformly random s-subset per row.
        keys = rng.random((int(candidates), m))
        subsets = np.argpartition(keys, s - 1, axis=1)[:, :s]
        cand = np.zeros((int(candidates), m), dtype=np.float32)
        np.put_along_axis(cand, subsets, 1.0, axis=1)
        if c:
            # Both rows have s ones, so Hamming = 2s - 2 * overlap: maximising the minimum distance
            # is minimising the largest overlap with any mask chosen so far (argmin: first on ties).
            worst_overlap = (cand @ chosen[:c].T).max(axis=1)
            best = int(np.argmin(worst_overlap))
        else:
            best = 0
        chosen[c] = cand[best]
    masks[:] = chosen > 0
    return masks


def min_pairwise_hamming(masks: np.ndarray) -> int:
    """Smallest Hamming distance between two different rows; m (the largest possible) if C < 2."""
    x = _as_masks(masks).astype(np.int64)
    C, m = x.shape
    if C < 2:
        return m
    sizes = x.sum(axis=1)
    ham = sizes[:, None] + sizes[None, :] - 2 * (x @ x.T)
    np.fill_diagonal(ham, m + 1)
    return int(ham.min())


def compress(p: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Eq. (8): the s values of `p` (m,) where `mask` is set, in ascending dim order, as float32."""
    p = np.asarray(p)
    mask = np.asarray(mask)
    if mask.dtype != bool or mask.ndim != 1 or p.shape != mask.shape:
        raise ValueError(f"CPS compress: need p (m,) and a bool mask (m,), got {p.shape} and {mask.dtype} {mask.shape}")
    return p[mask].astype(np.float32)


def reconstruct(values: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Eq. (7) from eq. (8): scatter the s values back onto the mask, zeros elsewhere, float32."""
    values = np.asarray(values)
    mask = np.asarray(mask)
    if mask.dtype != bool or mask.ndim != 1:
        raise ValueError(f"CPS reconstruct: mask must be a 1-D bool array, got {mask.dtype} {mask.shape}")
    s = int(mask.sum())
    if values.shape != (s,):
        raise ValueError(f"CPS reconstruct: expected {s} values for this class's mask, got shape {values.shape}")
    out = np.zeros(mask.shape[0], dtype=np.float32)
    out[mask] = values
    return out


def compress_table(protos: Mapping[int, np.ndarray], masks: np.ndarray) -> dict[int, np.ndarray]:
    """compress() for every class in the table, each with its own mask row."""
    masks = _as_masks(masks)
    return {c: compress(p, masks[_row(c, masks)]) for c, p in _items(protos)}


def reconstruct_table(values: Mapping[int, np.ndarray], masks: np.ndarray) -> dict[int, np.ndarray]:
    """reconstruct() for every class in the table."""
    masks = _as_masks(masks)
    return {c: reconstruct(v, masks[_row(c, masks)]) for c, v in _items(values)}


def pack_masks(masks: np.ndarray) -> np.ndarray:
    """(C, ceil(m/8)) uint8: each row packed big-endian by np.packbits, zero-padded to a byte."""
    return np.packbits(_as_masks(masks), axis=1)


def unpack_masks(packed: np.ndarray, num_classes: int, m: int) -> np.ndarray:
    """Inverse of pack_masks; rejects a wrong shape or set padding bits (a corrupt message)."""
    packed = np.asarray(packed)
    C, m = int(num_classes), int(m)
    nbytes = (m + 7) // 8
    if packed.dtype != np.uint8 or packed.shape != (C, nbytes):
        raise ValueError(f"CPS masks: expected uint8 of shape ({C}, {nbytes}), got {packed.dtype} {packed.shape}")
    bits = np.unpackbits(packed, axis=1)
    if bits[:, m:].any():
        raise ValueError("CPS masks: padding bits are set; the mask message is corrupt")
    return bits[:, :m].astype(bool)


def restrict_to_masks(P: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """Spherical CPS (ALGORITHMS.md, combined pipeline, candidate (b)): each row of unit prototypes P (C, m)
    cut to its class's mask and renormalised, so that it is a unit vector living on the mask's s dims.

    A row that is zero on its support has no direction there; it becomes the normalised mask itself
    (every support dim equal), a valid unit vector rather than a division by zero. Returns float32.
    """
    m = _as_masks(masks)
    P = np.asarray(P, dtype=np.float64)
    if P.shape != m.shape:
        raise ValueError(f"CPS: prototypes of shape {P.shape} for masks of shape {m.shape}")
    cut = np.where(m, P, 0.0)
    length = np.linalg.norm(cut, axis=1, keepdims=True)
    fallback = m / np.sqrt(np.maximum(m.sum(axis=1, keepdims=True), 1))
    return np.where(length > 0, cut / np.where(length > 0, length, 1.0), fallback).astype(np.float32)


def off_mask_energy(z: np.ndarray, y: np.ndarray, masks: np.ndarray) -> float:
    """Fraction of the features' energy outside their class's mask: sum_i ||z_i * (1 - m_{y_i})||^2 /
    sum_i ||z_i||^2 (0 for z = 0).

    CPS's alignment target is zero off the mask, so this is how far training has made z structured-sparse
    (ALGORITHMS.md, TinyProto: most of the alignment error is off-mask shrinkage; the benchmark reports it).
    """
    z = np.asarray(z, dtype=np.float64)
    off = ~_as_masks(masks)[np.asarray(y, dtype=np.int64)]
    total = float(np.square(z).sum())
    return float(np.square(z[off]).sum()) / total if total > 0 else 0.0


def _as_masks(masks: np.ndarray) -> np.ndarray:
    masks = np.asarray(masks)
    if masks.ndim != 2 or masks.dtype != bool:
        raise ValueError(f"CPS: masks must be a (C, m) bool array, got {masks.dtype} {masks.shape}")
    return masks


def _row(c: int, masks: np.ndarray) -> int:
    if not 0 <= c < masks.shape[0]:
        raise ValueError(f"CPS: class id {c} has no mask (masks cover classes 0..{masks.shape[0] - 1})")
    return c


def _items(table: Mapping[int, np.ndarray]) -> list[tuple[int, np.ndarray]]:
    out = []
    for c, v in table.items():
        if isinstance(c, bool) or not isinstance(c, (int, np.integer)):
            raise ValueError(f"CPS: class id must be an integer, got {c!r}")
        out.append((int(c), v))
    return out
