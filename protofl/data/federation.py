"""The federation's data recipe, one function per step, shared by the simulator, the server and devices.

`limit_train` (the `--train-limit` subset), `federation_split` (the client partition for (dataset, N,
alpha, seed)) and `public_set` (the server's public set) are the only places these choices are
made: a device loading `--partition i/N`, `protofl-server start --public-data` and the simulator
therefore see the same samples. numpy only.
"""

from __future__ import annotations

import numpy as np

from protofl.config import FederationConfig
from protofl.data.loaders import Dataset
from protofl.data.partition import FederatedSplit, build_federation, federation_public
from protofl.errors import ConfigError
from protofl.plan import RoundPlan
from protofl.wire import PublicSet

__all__ = ["federation_split", "limit_train", "public_indices", "public_set"]


def limit_train(train: Dataset, limit: int | None, seed: int) -> Dataset:
    """`--train-limit`: a seeded subset of the training set, taken before partitioning."""
    if limit is None or limit >= len(train):
        return train
    if limit < 1:
        raise ConfigError(f"--train-limit must be >= 1, got {limit}")
    keep = np.sort(np.random.default_rng([seed, 0x5EB]).permutation(len(train))[:limit])
    return train.subset(keep)


def federation_split(train: Dataset, clients: int, alpha: float, seed: int, cfg: FederationConfig) -> FederatedSplit:
    """The partition for (dataset, N, alpha, seed); the public set is carved for every preset, so that
    the clients' data is the same whichever method runs on it."""
    return build_federation(
        train.y,
        clients,
        alpha,
        seed,
        public_per_class=cfg.public_per_class,
        public_classes=cfg.public_classes,
        batch_size=cfg.batch_size,
    )


def public_indices(train: Dataset, cfg: FederationConfig) -> np.ndarray:
    """The samples of `train` the public set takes for `cfg` (carved for every preset, whatever its plan)."""
    return federation_public(train.y, cfg.seed, cfg.public_per_class, cfg.public_classes)


def public_set(train: Dataset, cfg: FederationConfig) -> PublicSet | None:
    """The server-held public set of a federation whose plan has public classes (None otherwise, or when it
    would be empty): the samples `federation_split` keeps out of every client for `cfg.seed`."""
    if not RoundPlan.from_config(cfg).public_classes:
        return None
    idx = public_indices(train, cfg)
    if len(idx) == 0:
        return None
    return PublicSet(
        x=train.x[idx], y=train.y[idx].astype(np.int64), classes=sorted(int(c) for c in np.unique(train.y[idx]))
    )
