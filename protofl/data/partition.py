"""Federated partitions: Dirichlet label skew, the server's public set, per-client train/test splits.

docs/algorithms.md, "Evaluation": Dirichlet(alpha) over classes, seeded, with a minimum client size (redraw
until every client has at least 2 batches); the partition for (dataset, N, alpha, seed) must be identical
across methods. Everything here is a pure function of its arguments: no global RNG, no dependence on the
method that will use the split, so FedAvg, FedProto, TinyProto, ... all see the same clients.
numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from protofl.errors import DataError

__all__ = [
    "MAX_REDRAWS",
    "SMALL_POOL_DIVISOR",
    "ClientSplit",
    "FederatedSplit",
    "build_federation",
    "carve_public",
    "client_min_size",
    "dirichlet_partition",
    "federation_public",
    "split_client",
]

MAX_REDRAWS = 1000
# build_federation asks each client for at most 1/SMALL_POOL_DIVISOR of its fair share (client_min_size).
SMALL_POOL_DIVISOR = 8

# Tags that give each stage of build_federation its own random stream (see _derive_seed).
_TAG_PUBLIC, _TAG_DIRICHLET, _TAG_SPLIT = 1, 2, 3


@dataclass
class ClientSplit:
    """One client's sample indices (into the training pool's labels): local train and held-out test."""

    train: np.ndarray
    test: np.ndarray

    def __len__(self) -> int:
        return int(len(self.train) + len(self.test))


@dataclass
class FederatedSplit:
    """The server-held public set and every client's split; all indices refer to the same label array."""

    public: np.ndarray
    clients: list[ClientSplit] = field(default_factory=list)

    @property
    def n_clients(self) -> int:
        return len(self.clients)


def _check_labels(labels: np.ndarray) -> np.ndarray:
    y = np.asarray(labels)
    if y.ndim != 1:
        raise DataError(f"labels must be 1-D, got shape {y.shape}")
    if len(y) and (not np.issubdtype(y.dtype, np.integer) or y.dtype == np.bool_):
        raise DataError(f"labels must be integers, got dtype {y.dtype}")
    if len(y) and int(y.min()) < 0:
        raise DataError(f"labels must be >= 0, found {int(y.min())}")
    return y.astype(np.int64, copy=False)


def _check_seed(seed: int) -> int:
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
        raise DataError(f"seed must be a non-negative int, got {seed!r}")
    return int(seed)


def _derive_seed(seed: int, *tags: int) -> int:
    """A child seed for one stage/client; SeedSequence mixing makes streams independent of each other."""
    return int(np.random.SeedSequence([seed, *tags]).generate_state(1, dtype=np.uint64)[0])


def dirichlet_partition(labels: np.ndarray, n_clients: int, alpha: float, seed: int, min_size: int) -> list[np.ndarray]:
    """Split positions 0..len(labels)-1 among clients with Dirichlet(alpha) label skew.

    For every class c (ascending), the shuffled samples of c are cut among the clients in proportions
    q_c ~ Dir(alpha * 1_N). The whole draw is repeated until every client holds >= ``min_size`` samples,
    at most MAX_REDRAWS times. Small alpha -> each client sees few classes; large alpha -> near-IID.
    Returns one sorted int64 index array per client; the arrays are disjoint and cover every position.
    """
    y = _check_labels(labels)
    seed = _check_seed(seed)
    if n_clients < 1:
        raise DataError(f"n_clients must be >= 1, got {n_clients}")
    if not (np.isfinite(alpha) and alpha > 0):
        raise DataError(f"Dirichlet alpha must be a positive finite number, got {alpha}")
    if min_size < 0:
        raise DataError(f"min_size must be >= 0, got {min_size}")
    if n_clients * min_size > len(y):
        raise DataError(
            f"cannot give {n_clients} clients at least {min_size} samples each from {len(y)} samples; "
            "use fewer clients or a smaller minimum size (min_batches / batch_size)"
        )
    rng = np.random.default_rng(seed)
    classes = np.unique(y)
    by_class = [np.flatnonzero(y == c) for c in classes]
    for _ in range(MAX_REDRAWS):
        parts: list[list[np.ndarray]] = [[] for _ in range(n_clients)]
        for idx in by_class:
            idx = rng.permutation(idx)
            q = rng.dirichlet(np.full(n_clients, float(alpha)))
            # Cut points from the cumulative proportions; the last client takes the rounding remainder.
            cuts = (np.cumsum(q)[:-1] * len(idx)).astype(np.int64)
            for k, chunk in enumerate(np.split(idx, cuts)):
                parts[k].append(chunk)
        sizes = [sum(len(c) for c in p) for p in parts]
        if min(sizes) >= min_size:
            return [np.sort(np.concatenate(p)).astype(np.int64) if p else np.zeros(0, np.int64) for p in parts]
    raise DataError(
        f"Dirichlet partition infeasible: after {MAX_REDRAWS} draws some of the {n_clients} clients still had "
        f"fewer than min_size={min_size} of {len(y)} samples with alpha={alpha}; raise alpha, lower "
        "min_size (min_batches / batch_size) or use fewer clients"
    )


def split_client(indices: np.ndarray, train_fraction: float = 0.75, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Seeded random split of one client's indices into (train, test), both sorted.

    train gets round(train_fraction * n) samples, but with n >= 2 each side keeps at least one sample
    (a client with no held-out data would silently drop out of the local-accuracy average).
    """
    if not 0.0 < train_fraction < 1.0:
        raise DataError(f"train_fraction must be in (0, 1), got {train_fraction}")
    seed = _check_seed(seed)
    idx = np.asarray(indices, dtype=np.int64)
    n = len(idx)
    n_train = int(round(train_fraction * n))
    if n >= 2:
        n_train = min(max(n_train, 1), n - 1)
    perm = np.random.default_rng(seed).permutation(idx)
    return np.sort(perm[:n_train]), np.sort(perm[n_train:])


def carve_public(labels: np.ndarray, per_class: int, classes: Sequence[int], seed: int) -> np.ndarray:
    """Draw ``per_class`` random samples of each class in ``classes``; sorted indices into ``labels``."""
    y = _check_labels(labels)
    seed = _check_seed(seed)
    if per_class < 0:
        raise DataError(f"public per_class must be >= 0, got {per_class}")
    cls = [int(c) for c in classes]
    if len(set(cls)) != len(cls):
        raise DataError(f"public classes must be distinct, got {cls}")
    if per_class == 0 or not cls:
        return np.zeros(0, dtype=np.int64)
    rng = np.random.default_rng(seed)
    picked = []
    for c in sorted(cls):  # sorted: the result must not depend on how the caller ordered the classes
        pool = np.flatnonzero(y == c)
        if len(pool) < per_class:
            raise DataError(
                f"public set: class {c} has {len(pool)} samples, fewer than the {per_class} per class asked"
            )
        picked.append(rng.choice(pool, size=per_class, replace=False))
    return np.sort(np.concatenate(picked)).astype(np.int64)


def client_min_size(pool_size: int, n_clients: int, min_batches: int = 2, batch_size: int = 64) -> int:
    """The minimum client size build_federation asks the Dirichlet draw for.

    min(min_batches * batch_size, pool_size // (SMALL_POOL_DIVISOR * n_clients)), floored at 2.
    The first term is the rule "every client has at least 2 batches". The cap keeps small datasets
    (synthetic smoke runs) partitionable: with label skew, a client's share of the pool is a sum of
    Beta(alpha, (N-1) alpha) variables and is often tiny, so a minimum near the fair share is almost never
    met. Measured with 10 classes: at alpha=0.1, N=20, a 1800-sample pool, a minimum of 1/2 of the fair
    share was met by 0 of 2000 draws, 1/4 by 1.6%, 1/8 by 16%; at N=50, 1/8 by 0.5%. So the cap is 1/8
    of the fair share. On Fashion-MNIST (60000 samples, N <= 50) the cap is >= 149 and the 2-batch rule
    (128) applies unchanged. The floor of 2 leaves every client one training and one held-out sample.
    """
    if n_clients < 1:
        raise DataError(f"n_clients must be >= 1, got {n_clients}")
    return max(2, min(min_batches * batch_size, pool_size // (SMALL_POOL_DIVISOR * n_clients)))


def federation_public(
    labels: np.ndarray, seed: int, public_per_class: int = 20, public_classes: Sequence[int] | None = None
) -> np.ndarray:
    """The public set :func:`build_federation` keeps out of every client for (labels, seed): sorted indices.

    ``public_per_class`` samples of each class in ``public_classes`` (None = every class present), drawn
    from the public stage's own stream, so a server can carve it without partitioning the clients.
    """
    y = _check_labels(labels)
    seed = _check_seed(seed)
    classes = np.unique(y).tolist() if public_classes is None else [int(c) for c in public_classes]
    return carve_public(y, public_per_class, classes, _derive_seed(seed, _TAG_PUBLIC))


def build_federation(
    labels: np.ndarray,
    n_clients: int,
    alpha: float,
    seed: int,
    public_per_class: int = 20,
    public_classes: Sequence[int] | None = None,
    min_batches: int = 2,
    batch_size: int = 64,
    train_fraction: float = 0.75,
) -> FederatedSplit:
    """The federation's data layout for (labels, N, alpha, seed), identical for every method.

    1. The public set is carved FIRST (``public_per_class`` per class of ``public_classes``, None = every
       class present), so no client holds a public sample; 0 means no public set.
    2. The remaining pool is Dirichlet-partitioned with
       min_size = :func:`client_min_size` = min(min_batches * batch_size, len(pool) // (8 * n_clients)),
       floored at 2: at least 2 batches per client, capped for small datasets (see there why 8).
    3. Each client's samples are split train/test (75/25 by default), with a per-client seed.
    Each stage draws from its own stream derived from ``seed``, so e.g. changing the public set size
    does not reshuffle the per-client splits' random state. All indices refer to ``labels``.
    """
    y = _check_labels(labels)
    seed = _check_seed(seed)
    if n_clients < 1:
        raise DataError(f"n_clients must be >= 1, got {n_clients}")
    if min_batches < 0 or batch_size < 1:
        raise DataError(f"min_batches must be >= 0 and batch_size >= 1, got {min_batches}, {batch_size}")
    public = federation_public(y, seed, public_per_class, public_classes)

    keep = np.ones(len(y), dtype=bool)
    keep[public] = False
    pool = np.flatnonzero(keep)
    min_size = client_min_size(len(pool), n_clients, min_batches, batch_size)
    if n_clients * min_size > len(pool):
        raise DataError(
            f"{len(pool)} samples (after the public set of {len(public)}) are too few for {n_clients} "
            f"clients with at least {min_size} each; use fewer clients or more data"
        )
    parts = dirichlet_partition(y[pool], n_clients, alpha, _derive_seed(seed, _TAG_DIRICHLET), min_size)

    clients = []
    for k, part in enumerate(parts):
        train, test = split_client(pool[part], train_fraction, _derive_seed(seed, _TAG_SPLIT, k))
        clients.append(ClientSplit(train=train, test=test))
    return FederatedSplit(public=public, clients=clients)
