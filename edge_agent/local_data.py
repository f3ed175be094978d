"""A device's private data from `--data`: a dataset spec or path, optionally one client's share.

`--partition i/N` (with the simulator's alpha and seed) takes client i's Dirichlet share of the same
(dataset, N, alpha, seed) partition the in-process simulator uses, plus the official test set for the
global/ensemble accuracy, so a federation of processes reproduces the in-process one. Without it the
device trains on the whole dataset, split 75/25 into local train and test.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from protofl.config import FederationConfig
from protofl.data import Dataset, load_dataset, split_client
from protofl.data.federation import federation_split, limit_train
from protofl.errors import ConfigError, DataError

if TYPE_CHECKING:
    from edge_agent.agent import ClientData

NAMED = ("fashion-mnist", "fashion_mnist", "fmnist", "synthetic")


@dataclass(frozen=True)
class DataSpec:
    data: str
    data_dir: str | None = None
    partition: tuple[int, int] | None = None  # (client index i, number of clients N)
    alpha: float = 0.5
    seed: int | None = None  # None: the federation's seed (as the simulator does)
    test_limit: int | None = None
    train_limit: int | None = None


def parse_partition(text: str) -> tuple[int, int]:
    """`i/N` with 0 <= i < N."""
    try:
        i_text, n_text = text.split("/")
        i, n = int(i_text), int(n_text)
    except ValueError:
        raise ConfigError(f"--partition expects i/N (e.g. 3/20), got '{text}'") from None
    if not 0 <= i < n:
        raise ConfigError(f"--partition {text}: need 0 <= i < N")
    return i, n


def dataset_spec(data: str) -> str:
    """A `--data` value as a `load_dataset` spec: specs pass through, an .npz file or a directory maps
    to `npz:` / `idx:`."""
    if data.split(":", 1)[0].lower() in NAMED + ("npz", "idx"):
        return data
    p = Path(data)
    if p.is_file() and p.suffix == ".npz":
        return f"npz:{p}"
    if p.is_dir():
        return f"idx:{p}"
    raise DataError(f"--data '{data}': not a dataset spec (fashion-mnist, synthetic[:...], npz:PATH, idx:DIR), "
                    f"an .npz file or a directory of IDX files")


def check_shape(train: Dataset, cfg: FederationConfig) -> None:
    if train.num_classes != cfg.num_classes or tuple(train.in_shape) != tuple(cfg.in_shape):
        raise DataError(f"this device's data has {train.num_classes} classes of shape {train.in_shape}, but the "
                        f"federation expects {cfg.num_classes} classes of shape {tuple(cfg.in_shape)}; "
                        f"use the dataset the federation was configured for")


def load_client_data(spec: DataSpec, cfg: FederationConfig, client_id: str) -> "ClientData":
    """This device's normalised train/test arrays (and, for a partition, the official test set)."""
    from edge_agent.agent import ClientData, stable_seed  # torch: only on the device side

    seed = cfg.seed if spec.seed is None else spec.seed
    train, test = load_dataset(dataset_spec(spec.data), data_dir=spec.data_dir, seed=seed)
    check_shape(train, cfg)
    train = limit_train(train, spec.train_limit, seed)
    x_global = y_global = None
    if spec.partition is not None:
        i, n = spec.partition
        part = federation_split(train, n, spec.alpha, seed, cfg).clients[i]
        tr, te = part.train, part.test
        if spec.test_limit is not None:
            test = test.subset(np.arange(min(spec.test_limit, len(test))))
        x_global, y_global = test.normalized(), test.y
    else:
        tr, te = split_client(np.arange(len(train)), 0.75, stable_seed(seed, client_id))
    return ClientData(x_train=train.normalized(tr), y_train=train.y[tr], x_test=train.normalized(te),
                      y_test=train.y[te], x_global=x_global, y_global=y_global, mean=train.mean, std=train.std)
