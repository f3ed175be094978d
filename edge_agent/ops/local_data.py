"""A device's private data from `--data`: a dataset spec or path, optionally one client's share.

`--partition i/N` (with the simulator's alpha and seed) takes client i's Dirichlet share of the same
(dataset, N, alpha, seed) partition the in-process simulator uses, plus the official test set for the
global/ensemble accuracy, so a federation of processes reproduces the in-process one. Without it the
device trains on its whole data and tests on the data's own test split, or on 25 % held out once.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from protofl.config import FederationConfig
from protofl.data import DATASET_SPECS, load_dataset, load_source, own, split_client
from protofl.data.dataset import Dataset, Images
from protofl.data.federation import federation_split, limit_train
from protofl.data.loaders import check_source
from protofl.errors import ConfigError, DataError

if TYPE_CHECKING:
    from edge_agent.core.client_data import ClientData

NAMED = ("fashion-mnist", "fashion_mnist", "fmnist", "synthetic")
PATH_KINDS = ("npz", "idx") + own.KINDS


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
    """A `--data` value as a `load_dataset` spec, checked for a missing file or folder ("not found").

    Specs pass through; a bare path maps by what it is: an .npz file to `npz:`, a .csv file to `csv:`, a
    directory with IDX files (or an empty one) to `idx:`, any other directory to `imagefolder:`."""
    kind, sep, arg = data.partition(":")
    kind = kind.strip().lower()
    if kind in NAMED:
        return data
    if kind in PATH_KINDS and sep:
        path = Path(own.path_of(arg))
        if not path.exists():
            raise DataError(f"--data '{data}': not found: {path} does not exist")
        return check_source(data)  # its options, and the files they name
    if own.is_loader(data) and not Path(data).exists():
        return data
    p = Path(data)
    if sep and re.fullmatch(r"[a-z][a-z_-]*", kind) and not p.exists():
        raise DataError(
            f"--data '{data}': unknown kind '{kind}'; use one of: {', '.join(DATASET_SPECS)} "
            "(a folder of class folders is imagefolder:DIR)"
        )
    if not p.exists():
        raise DataError(
            f"--data '{data}': not found: {p} does not exist (and it is not a dataset spec either: "
            f"{', '.join(DATASET_SPECS)})"
        )
    if p.is_file() and p.suffix.lower() in (".npz", ".csv"):
        return f"{p.suffix.lower()[1:]}:{p}"
    if p.is_dir():
        has_idx = any(p.glob("*idx[0-9]-ubyte*"))
        has_dirs = any(c.is_dir() for c in p.iterdir())
        return f"imagefolder:{p}" if has_dirs and not has_idx else f"idx:{p}"
    raise DataError(f"--data '{data}': cannot tell the format of {p}; name it: {', '.join(DATASET_SPECS)}")


def read_own(
    data: str,
    data_dir: str | None,
    seed: int,
    num_classes: int | None,
    in_shape: tuple[int, ...] | None,
    class_names: Sequence[str] | None,
) -> tuple[Dataset, Dataset | None]:
    """A device's own `--data` (no `--partition`) read and checked as join reads it: every file decoded (a bad one
    named), labels held to `num_classes`, class folders and a CSV's label names matched with `class_names` (a name
    the federation lacks refused), images to `in_shape`. `protofl-edge doctor --data` calls this very function."""
    return load_source(
        dataset_spec(data),
        data_dir=data_dir,
        seed=seed,
        holdout=None,
        num_classes=num_classes,
        in_shape=in_shape,
        class_names=class_names,
    )


def load_client_data(spec: DataSpec, cfg: FederationConfig, client_id: str) -> ClientData:
    """This device's train/test images (and, for a partition, the official test set), kept uint8 and normalised a
    batch at a time (`Images`: a quarter of a normalised copy's bytes).

    The federation's config is the truth about the classes and the input shape: the data may hold any
    subset of `cfg.num_classes` classes; a label outside [0, num_classes) or images of another shape are an
    error that says what the federation expects. Where the federation names its classes (`cfg.class_names`),
    class folders and a CSV's label names are matched with its names, and a name it does not have is refused.
    Without `--partition` the data's own test split (npz `x_test`/`y_test`, IDX `t10k`, an image folder's
    `test/`, a loader's 4-tuple) is the local test set, as given; data without one holds back 25 % once."""
    from edge_agent.core.client_data import ClientData, stable_seed

    seed = cfg.seed if spec.seed is None else spec.seed
    if spec.partition is not None:
        train, test = load_dataset(
            dataset_spec(spec.data),
            data_dir=spec.data_dir,
            seed=seed,
            num_classes=cfg.num_classes,
            in_shape=cfg.in_shape,
            class_names=cfg.class_names,
        )
        train = limit_train(train, spec.train_limit, seed)
        i, n = spec.partition
        part = federation_split(train, n, spec.alpha, seed, cfg).clients[i]
        tr, te = part.train, part.test
        if spec.test_limit is not None:
            test = test.subset(np.arange(min(spec.test_limit, len(test))))
        return ClientData(
            x_train=Images.of(train, tr),
            y_train=train.y[tr],
            x_test=Images.of(train, te),
            y_test=train.y[te],
            x_global=Images.of(test),
            y_global=test.y,
            mean=train.mean,
            std=train.std,
        )
    train, own_test = read_own(spec.data, spec.data_dir, seed, cfg.num_classes, cfg.in_shape, cfg.class_names)
    skipped = train.skipped_files  # reported to the server (Metrics.extra): a subset does not carry it
    train = limit_train(train, spec.train_limit, seed)
    if own_test is not None:
        return ClientData(
            x_train=Images.of(train),
            y_train=train.y,
            x_test=Images.of(own_test),
            y_test=own_test.y,
            mean=train.mean,
            std=train.std,
            skipped_files=skipped,
        )
    tr, te = split_client(np.arange(len(train)), 0.75, stable_seed(seed, client_id))
    return ClientData(
        x_train=Images.of(train, tr),
        y_train=train.y[tr],
        x_test=Images.of(train, te),
        y_test=train.y[te],
        mean=train.mean,
        std=train.std,
        skipped_files=skipped,
    )
