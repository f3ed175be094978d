"""Consensus aggregation and geometric refinement: FedPAGR (Prasad and Khan, paper 004), Secs. 3.3-3.5.

Client half (eq. 2, `client_prototypes`): p_kc = Normalize(mean of z_hat over D_kc), z_hat = z / ||z||.
The client's loss and head anchoring are torch (edge_agent/losses.fedpagr_loss, edge_agent/agent.py).

Server half:
    p_bar_c = Normalize((1 / |K_c|) sum_{k in K_c} p_kc)      over the clients K_c that sent c  (eq. 3)
    a class nobody sent keeps last round's prototype; round 0 uses seeded random unit vectors
    (Alg. 1 line 1).

Geometric refinement (eqs. 4-6, Alg. 1 lines 22-28): P (C x m) starts at [p_bar_1; ...; p_bar_C];
T steps of SGD with momentum 0.9 on the unconstrained P, normalising in the forward pass,

    L(P) = sum_c sum_{k in K_c} (1 - p_kc . P_hat_c)                 (eq. 5, agreement)
         + lambda_S * sum_{c != c'} max(0, P_hat_c . P_hat_c' - m)  (eq. 6, separation)

with P_hat the row-normalised P; then rows are projected back to the unit sphere. The separation
sum runs over ordered pairs, each unordered pair counted twice, as the paper states: "the
separation loss sums over all C(C-1) ordered class pairs" (Sec. 4.2.1, and again in Limitations).

The agreement term needs only per-class sums of the client prototypes:
sum_{k in K_c} (1 - p_kc . P_hat_c) = K_c - S_c . P_hat_c with S_c = sum_{k in K_c} p_kc, so the
accumulator keeps S (C x m) and K (C,) and never the uploads.

Gradient, written by hand (numpy only). With G = P_hat P_hat^T and A[c, c'] = 1 where c != c'
and G[c, c'] > m (the hinge is active; at exactly m the subgradient 0 is used, as torch's relu),

    dL/dP_hat = -S + 2 lambda_S A P_hat       (A is symmetric; the 2 is the ordered-pair count)
    dL/dP_c   = (I - P_hat_c P_hat_c^T) dL/dP_hat_c / ||P_c||   (through the normalisation)
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from protofl.algorithms.fedproto import local_prototypes

__all__ = [
    "normalize_rows",
    "client_prototypes",
    "initial_prototypes",
    "ConsensusAggregator",
    "refinement_loss_and_grad",
    "geometric_refine",
    "refine_anchor_table",
]


def normalize_rows(x: np.ndarray, eps: float = 1e-12) -> np.ndarray:
    """x / ||x|| along the last axis (a 1-D x is one row); norms below eps are treated as eps.

    Floating dtypes are kept (float32 in, float32 out), anything else becomes float64.
    """
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.floating):
        x = x.astype(np.float64)
    norms = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.maximum(norms, eps)


def client_prototypes(z: np.ndarray, y: np.ndarray, num_classes: int) -> dict[int, np.ndarray]:
    """Eq. (2): per class this client holds, the normalised mean of its normalised features."""
    protos, _ = local_prototypes(normalize_rows(z), y, num_classes)
    return {c: normalize_rows(p[None])[0] for c, p in protos.items()}


def initial_prototypes(num_classes: int, dim: int, seed: int) -> np.ndarray:
    """Round-0 prototypes: (C, m) float32 rows drawn uniformly on the unit sphere (normalised Gaussians)."""
    if int(num_classes) < 1 or int(dim) < 1:
        raise ValueError(f"refine: need num_classes >= 1 and dim >= 1, got {num_classes}, {dim}")
    rng = np.random.default_rng(seed)
    return normalize_rows(rng.standard_normal((int(num_classes), int(dim)))).astype(np.float32)


class ConsensusAggregator:
    """Eq. (3) as a stream: per-class sum S_c and sender count K_c of unit client prototypes."""

    def __init__(self, previous: np.ndarray) -> None:
        prev = np.asarray(previous)
        if prev.ndim != 2 or prev.shape[0] < 1 or prev.shape[1] < 1:
            raise ValueError(f"consensus: previous prototypes must be a (C, m) array, got shape {prev.shape}")
        prev = prev.astype(np.float64)
        if not np.isfinite(prev).all():
            raise ValueError("consensus: previous prototypes contain NaN or inf")
        self._previous = prev
        self.num_classes, self.dim = prev.shape
        self._sum = np.zeros_like(prev)
        self._count = np.zeros(self.num_classes, dtype=np.int64)
        self._senders = 0

    @property
    def senders(self) -> int:
        """How many uploads have been accepted."""
        return self._senders

    def add(self, protos: Mapping[int, np.ndarray]) -> None:
        """Fold in one client's unit prototypes; checked in full before anything is applied."""
        for c, v in self.check(protos):
            self._sum[c] += v
            self._count[c] += 1
        self._senders += 1

    def check(self, protos: Mapping[int, np.ndarray]) -> list[tuple[int, np.ndarray]]:
        """The upload's (class, unit row) pairs; raises ValueError, changing nothing, if any is invalid."""
        rows = []
        for c, p in protos.items():
            if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or not 0 <= int(c) < self.num_classes:
                raise ValueError(f"consensus: class id {c!r} is not an integer in [0, {self.num_classes})")
            v = np.asarray(p)
            if v.shape != (self.dim,):
                raise ValueError(f"consensus: prototype for class {c}: expected shape ({self.dim},), got {v.shape}")
            v = v.astype(np.float64)
            if not np.isfinite(v).all():
                raise ValueError(f"consensus: prototype for class {c} contains NaN or inf; drop this upload")
            length = float(np.linalg.norm(v))
            if length == 0.0:
                raise ValueError(f"consensus: prototype for class {c} is the zero vector; it has no direction")
            # Eq. (2) makes p_kc a unit vector; normalising again keeps a client that skipped that
            # step (or a lossy codec) from outweighing the others.
            rows.append((int(c), v / length))
        return rows

    def sums(self) -> tuple[np.ndarray, np.ndarray]:
        """(S, K): per-class sums of unit prototypes (C, m) float64 and sender counts (C,) int64, copies."""
        return self._sum.copy(), self._count.copy()

    def result(self) -> np.ndarray:
        """p_bar (C, m) float32: Normalize(S_c / K_c) where K_c > 0, else last round's row.

        A class whose submissions cancel exactly (S_c = 0) has no mean direction and also keeps
        last round's row.
        """
        out = self._previous.copy()
        length = np.linalg.norm(self._sum, axis=1)
        ok = (self._count > 0) & (length > 0)
        # Dividing by K_c does not change the direction, so normalising S_c is enough.
        out[ok] = self._sum[ok] / length[ok, None]
        return out.astype(np.float32)


def refinement_loss_and_grad(
    P: np.ndarray,
    S: np.ndarray,
    K: np.ndarray,
    lambda_s: float = 0.5,
    margin: float = 0.3,
) -> tuple[float, np.ndarray]:
    """L(P) of eqs. (4)-(6) and dL/dP (C, m) float64, in closed form.

    L = sum_c (K_c - S_c . P_hat_c) + lambda_s * sum_{c != c'} max(0, P_hat_c . P_hat_c' - margin),
    the second sum over ordered pairs (each unordered pair twice, as in the paper). Every row of P
    must be non-zero: the normalisation has no gradient at 0.
    """
    P = np.asarray(P, dtype=np.float64)
    S = np.asarray(S, dtype=np.float64)
    K = np.asarray(K, dtype=np.float64)
    if P.ndim != 2 or S.shape != P.shape or K.shape != (P.shape[0],):
        raise ValueError(f"refine: need P (C, m), S (C, m), K (C,), got {P.shape}, {S.shape}, {K.shape}")
    norms = np.linalg.norm(P, axis=1)
    if not (norms > 0).all():
        raise ValueError(f"refine: rows {np.flatnonzero(norms == 0).tolist()} of P are zero; they have no direction")
    Ph = P / norms[:, None]
    gram = Ph @ Ph.T
    excess = gram - margin
    active = excess > 0
    np.fill_diagonal(active, False)
    loss = float(K.sum() - (S * Ph).sum() + lambda_s * excess[active].sum())
    g_hat = -S + (2.0 * lambda_s) * (active.astype(np.float64) @ Ph)
    # Remove the radial part: the loss only sees the direction of each row.
    radial = (Ph * g_hat).sum(axis=1, keepdims=True)
    grad = (g_hat - radial * Ph) / norms[:, None]
    return loss, grad


def geometric_refine(
    P0: np.ndarray,
    S: np.ndarray,
    K: np.ndarray,
    steps: int = 5,
    lr: float = 0.01,
    momentum: float = 0.9,
    lambda_s: float = 0.5,
    margin: float = 0.3,
) -> np.ndarray:
    """Alg. 1 lines 22-28: `steps` of SGD with momentum on L, then rows projected to the unit sphere.

    Momentum is torch.optim.SGD's (dampening 0, no Nesterov): v <- momentum * v + g, P <- P - lr * v,
    with v = g on the first step. Returns (C, m) float32.
    """
    return _refine64(P0, S, K, steps, lr, momentum, lambda_s, margin).astype(np.float32)


def _refine64(
    P0: np.ndarray, S: np.ndarray, K: np.ndarray, steps: int, lr: float, momentum: float, lambda_s: float, margin: float
) -> np.ndarray:
    _check_hyper(steps, lr, momentum, lambda_s, margin)
    P = np.array(P0, dtype=np.float64)
    if P.ndim != 2 or not np.isfinite(P).all():
        raise ValueError(f"refine: P0 must be a finite (C, m) array, got shape {P.shape}")
    v = np.zeros_like(P)
    for _ in range(int(steps)):
        _, g = refinement_loss_and_grad(P, S, K, lambda_s, margin)
        v = momentum * v + g
        P -= lr * v
    return normalize_rows(P)


def refine_anchor_table(
    anchors: Mapping[int, np.ndarray],
    masks: np.ndarray | None = None,
    steps: int = 5,
    lr: float = 0.01,
    momentum: float = 0.9,
    lambda_s: float = 0.5,
    margin: float = 0.3,
) -> dict[int, np.ndarray]:
    """Geometric refinement of an anchor table for the combined pipeline (ALGORITHMS.md).

    Each anchor is cut to its class's mask support (when masks are given) and normalised; the
    present classes are refined together with S_c = that unit anchor and K_c = 1 (the anchor is
    the only "submission", so agreement pulls towards it and separation pushes apart the classes
    that overlap); off-support dims are zeroed again, the row renormalised on the support, and
    the anchor's original norm restored, so the magnitude the clients align to is unchanged.
    Classes absent from the table take no part. An anchor that is zero on its support has no
    direction and is returned unchanged. Returns float32 vectors.
    """
    _check_hyper(steps, lr, momentum, lambda_s, margin)
    if masks is not None:
        masks = np.asarray(masks)
        if masks.ndim != 2 or masks.dtype != bool:
            raise ValueError(f"refine: masks must be a (C, m) bool array, got {masks.dtype} {masks.shape}")
    out: dict[int, np.ndarray] = {}
    classes, rows, support, lengths = [], [], [], []
    for c, a in sorted(anchors.items(), key=lambda kv: int(kv[0])):
        c = int(c)
        a64 = np.asarray(a, dtype=np.float64)
        if a64.ndim != 1 or not np.isfinite(a64).all():
            raise ValueError(f"refine: anchor for class {c} must be a finite 1-D vector, got shape {a64.shape}")
        if masks is not None:
            if not 0 <= c < masks.shape[0] or masks.shape[1] != a64.shape[0]:
                raise ValueError(f"refine: no mask of length {a64.shape[0]} for class {c} (masks {masks.shape})")
            keep = masks[c]
        else:
            keep = np.ones(a64.shape[0], dtype=bool)
        restricted = np.where(keep, a64, 0.0)
        if not np.linalg.norm(restricted) > 0:
            out[c] = a64.astype(np.float32)
            continue
        classes.append(c)
        rows.append(restricted)
        support.append(keep)
        lengths.append(float(np.linalg.norm(a64)))
    if not classes:
        return out
    dims = {r.shape[0] for r in rows}
    if len(dims) != 1:
        raise ValueError(f"refine: anchors have different lengths {sorted(dims)}")
    P0 = normalize_rows(np.stack(rows))
    refined = _refine64(P0, P0, np.ones(len(classes)), steps, lr, momentum, lambda_s, margin)
    refined = np.where(np.stack(support), refined, 0.0)
    norms = np.linalg.norm(refined, axis=1)
    for i, c in enumerate(classes):
        # Refinement can in principle move all of a row's mass off its support; then the
        # unrefined direction is the only one left that respects the mask.
        direction = refined[i] / norms[i] if norms[i] > 0 else P0[i]
        out[c] = (lengths[i] * direction).astype(np.float32)
    return dict(sorted(out.items()))


def _check_hyper(steps: int, lr: float, momentum: float, lambda_s: float, margin: float) -> None:
    if int(steps) < 0:
        raise ValueError(f"refine: steps must be >= 0, got {steps}")
    for name, val in (("lr", lr), ("momentum", momentum), ("lambda_s", lambda_s), ("margin", margin)):
        if not math.isfinite(float(val)):
            raise ValueError(f"refine: {name} must be finite, got {val!r}")
    if lr < 0 or lambda_s < 0 or not 0 <= momentum < 1:
        raise ValueError(f"refine: need lr >= 0, lambda_s >= 0, 0 <= momentum < 1; got {lr}, {lambda_s}, {momentum}")
