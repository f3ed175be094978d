"""The federation's data recipe, one function per step, shared by the simulator, the server and devices.

`limit_train` (the `--train-limit` subset), `federation_split` (the client partition for (dataset, N,
alpha, seed)) and `public_set` (the server's public set) are the only places these choices are
made: a device loading `--partition i/N`, `protofl-server start --public-data` and the simulator
therefore see the same samples. numpy only.

The public set's size (`public_size`): `public_per_class` per class, carved for every preset wherever the
data has that many of each class, so that methods compared on the same data (Fashion-MNIST: 6000 a class)
hold the same client data. Where a class has fewer (small own data, where a carve failed before):
a federation that uses no public set (neither ERPA's anchors nor the ridge predictor's trained shared
backbone) draws none and its clients keep every sample; one that uses it takes what the data can give
(`fit_public`: a quarter of the smallest class, at least 1 a class) unless the user fixed
`public_per_class`, and an error says which option to set where even that does not fit.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from protofl.config import FederationConfig
from protofl.data.loaders import Dataset
from protofl.data.partition import FederatedSplit, build_federation, federation_public
from protofl.errors import ConfigError, DataError
from protofl.plan import RoundPlan
from protofl.wire import PublicSet

__all__ = [
    "fit_public",
    "federation_split",
    "limit_train",
    "public_indices",
    "public_set",
    "public_size",
    "public_user",
    "server_split",
    "stratified_holdout",
    "with_shared_backbone",
]

log = logging.getLogger("protofl.data")

# The share of its smallest class a public set fitted to small own data takes at most (the clients keep the rest).
PUBLIC_SHARE = 4


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
        public_per_class=public_size(train.y, cfg),
        public_classes=cfg.public_classes,
        batch_size=cfg.batch_size,
    )


def public_indices(train: Dataset, cfg: FederationConfig) -> np.ndarray:
    """The samples of `train` the public set takes for `cfg` (carved for every preset, whatever its plan)."""
    return federation_public(train.y, cfg.seed, public_size(train.y, cfg), cfg.public_classes)


def public_user(cfg: FederationConfig) -> str | None:
    """The option that switches off the active technique that uses the public set's samples (None: none does):
    "erpa" (anchors on the public classes) or "ridge" (the shared backbone, trained on them where
    backbone_epochs > 0)."""
    plan = RoundPlan.from_config(cfg)
    if plan.public_classes:
        return "erpa"
    if plan.shared_backbone and int(cfg.backbone_epochs) > 0:
        return "ridge"
    return None


def _smallest_class(labels: np.ndarray, cfg: FederationConfig) -> tuple[int, int]:
    """(class, count) of the public set's class (`cfg.public_classes`, None = every class present) with the fewest
    samples in `labels`."""
    y = np.asarray(labels)
    classes = np.unique(y).tolist() if cfg.public_classes is None else [int(c) for c in cfg.public_classes]
    if not classes:
        return -1, 0
    counts = [(int(np.count_nonzero(y == c)), int(c)) for c in sorted(classes)]
    have, c = min(counts)
    return c, have


def _too_few(c: int, have: int, want: int, user: str, cfg: FederationConfig) -> DataError:
    uses = "ERPA's anchors" if user == "erpa" else "the ridge predictor's shared backbone"
    fit = have // PUBLIC_SHARE
    set_size = f"--set public_per_class={fit} (a quarter of class {c}'s samples) or " if 0 < fit < want else ""
    return DataError(
        f"public set: class {c} has {have} samples, fewer than the {want} per class asked; preset "
        f"'{cfg.preset}' uses the public set ({uses}): use {set_size}--set {user}=false to run without it"
    )


def public_size(labels: np.ndarray, cfg: FederationConfig) -> int:
    """The public set's samples per class for (labels, cfg): `cfg.public_per_class` where every class of the set
    has that many (carved whatever the preset, so methods compared on the same data hold the same client data);
    0 where one has fewer and no active technique uses a public set (nothing drawn, the clients keep every
    sample); a DataError naming the options to set where one does (`fit_public` fits the config first)."""
    want = int(cfg.public_per_class)
    if want == 0:
        return 0
    c, have = _smallest_class(labels, cfg)
    if have >= want:
        return want
    user = public_user(cfg)
    if user is None:
        return 0
    raise _too_few(c, have, want, user, cfg)


def fit_public(train: Dataset, cfg: FederationConfig, fixed: bool, server_only: bool = False) -> FederationConfig:
    """`cfg` with a public set that fits `train` (said once in the log): where a class has fewer than
    `public_per_class` samples and a technique uses the public set, a quarter of the smallest class (at least 1),
    unless the user `fixed` public_per_class (then, as where even 1 does not fit, a DataError names the options), or
    all of it where the data is the server's only (`server_only`: `start --public-data`, which no device holds);
    where no technique uses it, public_per_class 0 (none drawn). Unchanged where the data has enough."""
    want = int(cfg.public_per_class)
    if want == 0:
        return cfg
    c, have = _smallest_class(train.y, cfg)
    if have >= want:
        return cfg
    user = public_user(cfg)
    if user is None:
        log.info(
            "no public set: preset '%s' uses none, and class %d has %d samples, fewer than public_per_class %d",
            cfg.preset,
            c,
            have,
            want,
        )
        return cfg.replace(public_per_class=0)
    if server_only and not fixed:
        # `start --public-data`: the server's own data, which no device holds: all of its smallest class, said
        log.info(
            "public set: %d per class, %d images (all of class %d's %d; public_per_class %d does not fit this data)",
            have,
            have * len(np.unique(train.y) if cfg.public_classes is None else cfg.public_classes),
            c,
            have,
            want,
        )
        return cfg.replace(public_per_class=have)
    fit = have // PUBLIC_SHARE
    if fixed or fit < 1:
        raise _too_few(c, have, want, user, cfg)
    log.warning(
        "public set: %d per class (a quarter of class %d's %d samples; public_per_class %d does not fit this data)",
        fit,
        c,
        have,
        want,
    )
    return cfg.replace(public_per_class=fit)


def stratified_holdout(labels: np.ndarray, share: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(kept, held) row numbers: `share` of each class held out (rounded, at least 1 where the class has 2 or more,
    never all of it), seeded; both sorted."""
    y = np.asarray(labels)
    rng = np.random.default_rng([seed, 0x5A11])
    held: list[np.ndarray] = []
    for c in np.unique(y):
        rows = rng.permutation(np.flatnonzero(y == c))
        n = 0 if share <= 0 or len(rows) < 2 else min(len(rows) - 1, max(1, int(round(share * len(rows)))))
        held.append(rows[:n])
    out = np.sort(np.concatenate(held)) if held else np.zeros(0, np.int64)
    return np.setdiff1d(np.arange(len(y)), out), out


def server_split(
    data: Dataset, own_test: Dataset | None, share: float, seed: int, spec: str
) -> tuple[Dataset, Dataset]:
    """`start --public-data D --validation D`: (the public data, the validation data) of one data set. Its own
    test split where it has one; else a stratified `share` of each class held out for validation, disjoint from the
    rest (the sizes said in the log); `share` 0: all of it for both, with a warning (validation is optimistic)."""
    if own_test is not None:
        log.info("--validation %s: its test split (%d images), disjoint from the public data", spec, len(own_test.y))
        return data, own_test
    if not 0 <= share < 1:
        raise ConfigError(f"--validation-share must be in [0, 1), got {share}")
    if share == 0:
        log.warning(
            "--validation %s is --public-data with --validation-share 0: all %d images train the shared backbone "
            "and validation scores those same images, so its accuracy is optimistic (not a held-out figure)",
            spec,
            len(data.y),
        )
        return data, data
    kept, held = stratified_holdout(data.y, share, seed)
    counts = np.bincount(np.asarray(data.y)[held], minlength=data.num_classes)
    log.info(
        "--validation %s is --public-data: a stratified %.0f %% of each class held out for validation (%d images, "
        "%d-%d a class), the other %d for the public set and the shared backbone (--validation-share)",
        spec,
        100 * share,
        len(held),
        int(counts[counts > 0].min()) if counts.any() else 0,
        int(counts.max()),
        len(kept),
    )
    return data.subset(kept), data.subset(held)


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


def with_shared_backbone(
    public: PublicSet | None,
    train: Dataset,
    backbone: np.ndarray,
    graph: bytes | None = None,
    layout: list[tuple[str, tuple[int, ...]]] | None = None,
) -> PublicSet:
    """The public message carrying the shared backbone trained on `train`'s public samples, with the normalisation
    its inputs had (`train`'s): the public set where there is one, else a set of zero samples; with its ONNX graph
    for lite devices where one is given (protofl/lite.py)."""
    norm = ([float(v) for v in train.mean], [float(v) for v in train.std])
    if public is None:
        return PublicSet(
            x=train.x[:0], y=np.zeros(0, np.int64), classes=[], backbone=backbone, norm=norm, graph=graph, layout=layout
        )
    return dataclasses.replace(public, backbone=backbone, norm=norm, graph=graph, layout=layout)
