"""CPS, class-wise prototype sparsification: TinyProto (Lee et al., paper 002), Sec. 4.1.2.

One binary mask m_c in {0,1}^m per class, with exactly s ones, shared by server and clients.

    structured sparse prototype   c~ = S(c; m_c) = c * m_c            (eq. 7, zeros off the mask)
    compressed prototype          c^ = C(c; m_c) = (c_i : m_c,i = 1)   (eq. 8, s values, no indices)

Masks: the paper only says "we typically maximize pairwise Hamming distances between the masking
vectors". Ours (docs/algorithms.md, "TinyProto"): if C * s <= m the supports are disjoint, cut from one
seeded permutation, so every pair is at the largest possible distance 2s. Otherwise a seeded
greedy: for each class in turn draw `candidates` random s-subsets and keep the one whose minimum
Hamming distance to the masks already chosen is largest (first candidate on ties).

Server side there is no state: the server aggregates compressed vectors class by class (fedproto
or scaling accumulators with dim = s) and ships the masks once, packed to bits. Compression and
reconstruction are protofl/algorithms/support.py (every rule reads prototypes through it); prototype
scaling (scaling.py) is part of this technique, as in the paper. The device half is
edge_agent/techniques/cps.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from protofl.algorithms.scaling import ScaledAggregator
from protofl.algorithms.support import as_masks
from protofl.errors import ConfigError
from protofl.technique import (
    Option,
    PlanDraft,
    PrototypeMean,
    ServerRule,
    ServerState,
    Technique,
    flag,
    integer,
    is_number,
)

if TYPE_CHECKING:
    from protofl.config import FederationConfig

__all__ = ["make_masks", "min_pairwise_hamming", "pack_masks", "unpack_masks", "support_size", "Cps"]


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
    x = as_masks(masks).astype(np.int64)
    C, m = x.shape
    if C < 2:
        return m
    sizes = x.sum(axis=1)
    ham = sizes[:, None] + sizes[None, :] - 2 * (x @ x.T)
    np.fill_diagonal(ham, m + 1)
    return int(ham.min())


def pack_masks(masks: np.ndarray) -> np.ndarray:
    """(C, ceil(m/8)) uint8: each row packed big-endian by np.packbits, zero-padded to a byte."""
    return np.packbits(as_masks(masks), axis=1)


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


# -- the technique ------------------------------------------------------------------------------------
def support_size(cfg: FederationConfig) -> int:
    """TinyProto's s, the values per class on the wire (default m/10)."""
    return cfg.cps_s if cfg.cps_s is not None else max(1, cfg.proto_dim // 10)


def _mu_check(v: Any) -> str | None:
    ok = v == "auto" or (is_number(v) and v > 0)
    return None if ok else f"mu must be a positive number or 'auto', got {v!r}"


class Cps(Technique):
    """TinyProto: class-wise prototype sparsification (masks, s values per class) and prototype scaling."""

    name = "cps"
    order = 50
    options = {
        "cps": flag("cps"),
        "cps_s": integer("cps_s", None, 1, ""),  # None = m // 10
        "scaling": flag("scaling"),
        "mu": Option(1.5e-4, _mu_check),  # a float, or "auto" (rescale G_c to the client's own prototype norm)
    }

    def active(self, cfg: FederationConfig) -> bool:
        return bool(cfg.cps or cfg.scaling)

    def check(self, cfg: FederationConfig) -> None:
        s = support_size(cfg)
        if not 1 <= s <= cfg.proto_dim:
            raise ConfigError(f"cps_s must be in [1, proto_dim], got {s}")
        if cfg.cps and cfg.prototypes == "none":
            raise ConfigError("cps compresses prototypes; set prototypes='mean'")
        if cfg.scaling and cfg.prototypes == "none":
            raise ConfigError("scaling needs prototypes='mean'")
        if cfg.scaling and cfg.prototypes == "unit":
            raise ConfigError(
                "scaling multiplies mean prototypes by their counts; unit prototypes have none: turn scaling off"
            )
        if cfg.refine and cfg.cps and cfg.num_classes * s <= cfg.proto_dim:
            if cfg.prototypes == "unit":
                raise ConfigError(
                    f"refine on spherical CPS prototypes whose masks do not overlap (num_classes * cps_s = "
                    f"{cfg.num_classes * s} <= proto_dim = {cfg.proto_dim}) changes nothing: they are already "
                    f"orthogonal; use cps_s > {cfg.proto_dim // cfg.num_classes} so that masks overlap, or turn "
                    f"refine off"
                )
            raise ConfigError(
                f"refine with CPS masks that do not overlap (num_classes * cps_s = {cfg.num_classes * s} <= "
                f"proto_dim = {cfg.proto_dim}) changes nothing: masked anchors are already orthogonal; use "
                f"cps_s > {cfg.proto_dim // cfg.num_classes} so that masks overlap, or turn refine off"
            )

    def shape(self, draft: PlanDraft, cfg: FederationConfig) -> None:
        if cfg.cps:
            draft.masked = True
            draft.proto_width = support_size(cfg)
            draft.target_label = ["cps"] if draft.target_label == ["dense"] else [*draft.target_label, "cps"]
        if cfg.scaling:
            draft.target_label.append("scaled")

    def server_rule(self, model: ServerState) -> ServerRule:
        return CpsRule(model)


class CpsRule(ServerRule):
    """The masks are a function of the config (its seed): made once, offered to every rule, never checkpointed."""

    def __init__(self, model: ServerState) -> None:
        super().__init__(model)
        cfg = model.cfg
        self.masks = make_masks(cfg.num_classes, cfg.proto_dim, support_size(cfg), seed=cfg.seed) if cfg.cps else None

    def support_masks(self) -> np.ndarray | None:
        return self.masks

    def mean_aggregator(self, width: int) -> PrototypeMean | None:
        """Scaling: the server sees n_kc * p_kc only, aggregated by eq. (10)."""
        return ScaledAggregator(self.model.plan.num_classes, width) if self.model.cfg.scaling else None
