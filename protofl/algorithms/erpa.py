"""ERPA, external-referenced prototype alignment: RefProtoFL (Wu et al., paper 000), Sec. 4.2, Alg. 3-5.

delta_c = 1 if the server's public set has no sample of class c (eq. 12); "public-covered" below
means delta_c = 0.

Client half (Alg. 3, `client_prototypes`; z from the device's backbone and the broadcast adapter):
    public-covered c:            p_kc^pub = mean of z over the public samples of c          (eq. 10)
    not covered and n_kc > 0:    p_kc     = mean of z over D_kc, sent with n_kc             (eq. 11)
(the means themselves are fedproto.local_prototypes). Training then aligns z to the anchors
(eq. 17, on the MSE scale of ALGORITHMS.md; the torch term is edge_agent/losses.alignment).

Server half (Alg. 4):
    p_c^ext = uniform mean of p_kc^pub over the clients that sent c                       (eq. 14)
    p_c^g   = sum_{k in U_c} n_kc p_kc / sum_{k in U_c} n_kc over the senders U_c of c   (eqs. 13, 15)
Anchors (Alg. 5 line 2, eq. 16):
    a_c = p_c^ext if c is public-covered, else p_c^g; absent if no client sent c.

Eq. (14) divides by |S^t|, all selected clients; we divide by the clients that actually sent
p_kc^pub. The two agree whenever every participant uploads every public class (what Alg. 3 does);
ours stays a mean when an upload is lost or a client skips a class.

Streaming: two prototype accumulators (fedproto.PrototypeAggregator), uniform for ext and
n-weighted for g, so memory is O(C m) whatever the number of clients.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from protofl.algorithms.fedproto import PrototypeAggregator, local_prototypes

__all__ = ["client_prototypes", "ErpaAggregator", "combine_anchors", "unit_anchors"]


def client_prototypes(
    z_public: np.ndarray | None,
    y_public: np.ndarray | None,
    z_local: np.ndarray,
    y_local: np.ndarray,
    num_classes: int,
    public_classes: Iterable[int],
) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray], dict[int, int]]:
    """Alg. 3: (p^pub for public-covered classes, p for the uncovered classes this client holds, n_kc).

    `z_public` is None when the device holds no public set (then it sends no public prototypes).
    """
    public = {int(c) for c in public_classes}
    pub: dict[int, np.ndarray] = {}
    if public and z_public is not None and y_public is not None:
        protos, _ = local_prototypes(z_public, y_public, num_classes)
        pub = {c: p for c, p in protos.items() if c in public}
    protos, counts = local_prototypes(z_local, y_local, num_classes)
    local = {c: p for c, p in protos.items() if c not in public}
    return pub, local, {c: counts[c] for c in local}


class ErpaAggregator:
    """Alg. 4: external-reference prototypes for public classes, n-weighted global ones for the rest."""

    def __init__(self, num_classes: int, dim: int, public_classes: Sequence[int]) -> None:
        public = [int(c) for c in public_classes]
        if len(set(public)) != len(public):
            raise ValueError(f"ERPA: public_classes has duplicates: {sorted(public)}")
        bad = [c for c in public if not 0 <= c < int(num_classes)]
        if bad:
            raise ValueError(f"ERPA: public classes {bad} out of range [0, {num_classes})")
        self.public_classes = frozenset(public)
        self._ext = PrototypeAggregator(num_classes, dim, weighting="mean")
        self._glob = PrototypeAggregator(num_classes, dim, weighting="weighted")
        self._senders = 0

    @property
    def senders(self) -> int:
        """How many client uploads have been accepted."""
        return self._senders

    def add(
        self,
        public: Mapping[int, np.ndarray],
        local: Mapping[int, np.ndarray],
        local_counts: Mapping[int, int],
    ) -> None:
        """One client's Alg. 3 upload. Public prototypes only for public-covered classes, local ones
        (with n_kc) only for the others; anything else is rejected and leaves the state unchanged."""
        wrong_pub = sorted(int(c) for c in public if int(c) not in self.public_classes)
        if wrong_pub:
            raise ValueError(
                f"ERPA: public prototypes sent for classes {wrong_pub}, which have no public data; "
                "send local prototypes (with counts) for those"
            )
        wrong_loc = sorted(int(c) for c in local if int(c) in self.public_classes)
        if wrong_loc:
            raise ValueError(
                f"ERPA: local prototypes sent for public-covered classes {wrong_loc}; "
                "those are anchored by public prototypes only (keeps the label histogram private)"
            )
        # Check both tables before applying either, so a bad local table cannot leave a half-applied upload.
        ext_rows = self._ext._prepare(public, None)
        glob_rows = self._glob._prepare(local, local_counts)
        self._ext._apply(ext_rows)
        self._glob._apply(glob_rows)
        self._senders += 1

    def ext_prototypes(self) -> dict[int, np.ndarray]:
        """p_c^ext (eq. 14) for the public-covered classes somebody sent."""
        return self._ext.result()

    def global_prototypes(self) -> dict[int, np.ndarray]:
        """p_c^g (eq. 15) for the uncovered classes somebody sent."""
        return self._glob.result()

    def anchors(self) -> dict[int, np.ndarray]:
        """a_c (eq. 16) for every class that has one."""
        return combine_anchors(self.ext_prototypes(), self.global_prototypes(), self.public_classes)


def combine_anchors(
    ext: Mapping[int, np.ndarray],
    glob: Mapping[int, np.ndarray],
    public_classes: Iterable[int],
) -> dict[int, np.ndarray]:
    """Eq. (16) as a pure function: a_c = ext[c] for public-covered c, glob[c] otherwise.

    The combined pipeline passes scaled-aggregation results as `glob`, which may hold public
    classes too. Those are ignored while ext[c] exists; if no client's public prototype for c
    arrived this round, glob[c] stands in rather than leaving the class without an anchor.
    External prototypes for classes that are not public-covered are ignored (eq. 16 gives them
    weight 1 - delta_c = 0). A class in neither table has no anchor.
    """
    public = {int(c) for c in public_classes}
    out: dict[int, np.ndarray] = {}
    for c in sorted({int(c) for c in glob} | {int(c) for c in ext if int(c) in public}):
        if c in public and c in ext:
            out[c] = np.asarray(ext[c], dtype=np.float32).copy()
        elif c in glob:
            out[c] = np.asarray(glob[c], dtype=np.float32).copy()
    return out


def unit_anchors(ext_sum: np.ndarray, ext_count: np.ndarray, consensus: np.ndarray,
                 public_classes: Iterable[int]) -> np.ndarray:
    """Eq. (16) on the unit sphere (the combined pipeline's candidate (d), ALGORITHMS.md): the anchor of a
    public-covered class c that some client sent is the normalised uniform mean of the clients' unit
    public-set prototypes, normalize(ext_sum[c] / ext_count[c]) (eq. 14, then normalised like FedPAGR's
    eq. 3); every other row is FedPAGR's consensus prototype `consensus[c]` (which already keeps last
    round's row for a class nobody sent).

    `ext_sum` (C, m) and `ext_count` (C,) are a ConsensusAggregator's sums over the public prototypes;
    returns a new (C, m) float64 array with unit rows where ext rows were used.
    """
    out = np.array(consensus, dtype=np.float64, copy=True)
    S, K = np.asarray(ext_sum, dtype=np.float64), np.asarray(ext_count)
    if S.shape != out.shape or K.shape != (out.shape[0],):
        raise ValueError(f"ERPA unit anchors: sums {S.shape} / counts {K.shape} do not match prototypes {out.shape}")
    for c in sorted({int(c) for c in public_classes}):
        if K[c] > 0:
            norm = float(np.linalg.norm(S[c]))
            if norm > 0.0:  # opposite directions cancelling exactly: keep the consensus row
                out[c] = S[c] / norm
    return out
