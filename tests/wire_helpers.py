"""Decoded messages as the kind a test sent.

`decode_message` returns the union of every message kind; a test knows which kind it encoded and says
so here, which both checks it and gives the type checker the message's own fields."""

from __future__ import annotations

from typing import TypeVar

import numpy as np

from protofl.algorithms.ridge import ridge_length, ridge_statistics
from protofl.config import FederationConfig
from protofl.sparse import SparseVector
from protofl.wire import Message, ParamsUpload, decode_message

M = TypeVar("M", bound=Message)


def decode_as(kind: type[M], data: bytes) -> M:
    """The message in `data`, which must be a `kind`."""
    _, msg = decode_message(data)
    assert isinstance(msg, kind), f"expected {kind.__name__}, decoded {type(msg).__name__}"
    return msg


def ridge_upload(cfg: FederationConfig, round_: int, n_samples: int, rng: np.random.Generator) -> ParamsUpload:
    """A device's parameter upload for the ridge predictor (protofl/algorithms/ridge.py): its statistics of
    `n_samples` random features in round 1, empty after (what a device that sent them sends)."""
    n = ridge_length(cfg.proto_dim, cfg.num_classes)
    if round_ > 1:
        return ParamsUpload(
            update=SparseVector(n, np.zeros(0, np.int64), np.zeros(0, np.float32)),
            n_samples=n_samples,
            base_round=round_,
        )
    h = rng.normal(size=(n_samples, cfg.proto_dim))
    y = rng.integers(0, cfg.num_classes, n_samples)
    return ParamsUpload(update=ridge_statistics(h, y, cfg.num_classes), n_samples=n_samples, base_round=round_)
