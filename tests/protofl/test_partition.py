"""Federated partitions: Dirichlet label skew, the public set, per-client splits, determinism."""

from __future__ import annotations

import os

import numpy as np
import pytest

from protofl.config import FederationConfig
from protofl.data import (
    FASHION_MNIST_DIR,
    Dataset,
    build_federation,
    carve_public,
    dirichlet_partition,
    load_fashion_mnist,
    make_synthetic,
    split_client,
)
from protofl.data.partition import MAX_REDRAWS, client_min_size
from protofl.errors import DataError

LABELS = np.repeat(np.arange(10), 100)  # 1000 samples, 100 per class


def assert_disjoint_cover(parts: list[np.ndarray], n: int) -> None:
    allidx = np.concatenate(parts)
    assert len(allidx) == n and np.array_equal(np.sort(allidx), np.arange(n))


def test_dirichlet_is_deterministic_and_seed_dependent() -> None:
    a = dirichlet_partition(LABELS, 8, 0.5, seed=3, min_size=20)
    b = dirichlet_partition(LABELS, 8, 0.5, seed=3, min_size=20)
    c = dirichlet_partition(LABELS, 8, 0.5, seed=4, min_size=20)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


@pytest.mark.parametrize("alpha", [0.05, 0.5, 100.0])
def test_dirichlet_disjoint_cover_sorted_min_size(alpha: float) -> None:
    parts = dirichlet_partition(LABELS, 5, alpha, seed=0, min_size=30)
    assert len(parts) == 5
    assert_disjoint_cover(parts, len(LABELS))
    for p in parts:
        assert p.dtype == np.int64 and len(p) >= 30 and np.all(np.diff(p) > 0)


def test_dirichlet_alpha_controls_skew() -> None:
    def classes_per_client(alpha: float) -> float:
        parts = dirichlet_partition(LABELS, 10, alpha, seed=0, min_size=10)
        # classes holding at least 5% of the client's samples (IID would be 10% each)
        return float(np.mean([(np.bincount(LABELS[p], minlength=10) >= 0.05 * len(p)).sum() for p in parts]))

    assert classes_per_client(1000.0) == 10  # near-IID: every class ~10% on every client
    assert classes_per_client(0.05) < 5  # strong skew: a few classes per client (2.6 here)


def test_dirichlet_infeasible_gives_up_with_explanation() -> None:
    labels = np.repeat(np.arange(2), 50)
    with pytest.raises(DataError, match=rf"after {MAX_REDRAWS} draws.*min_size=20.*alpha=0.01") as e:
        dirichlet_partition(labels, 5, 0.01, seed=0, min_size=20)
    assert "raise alpha" in str(e.value)
    # Asking for more than there is fails at once, without drawing.
    with pytest.raises(DataError, match="cannot give 5 clients at least 30 samples each from 100"):
        dirichlet_partition(labels, 5, 1.0, seed=0, min_size=30)


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        ({"n_clients": 0}, "n_clients"),
        ({"alpha": 0.0}, "alpha"),
        ({"alpha": float("inf")}, "alpha"),
        ({"min_size": -1}, "min_size"),
        ({"seed": -1}, "seed"),
    ],
)
def test_dirichlet_argument_checks(kwargs: dict, reason: str) -> None:
    args = {"labels": LABELS, "n_clients": 3, "alpha": 1.0, "seed": 0, "min_size": 1} | kwargs
    with pytest.raises(DataError, match=reason):
        dirichlet_partition(**args)


def test_split_client_sizes() -> None:
    idx = np.arange(100, 200)
    train, test = split_client(idx, 0.75, seed=1)
    assert (len(train), len(test)) == (75, 25)
    assert np.array_equal(np.sort(np.concatenate([train, test])), idx)
    assert np.all(np.diff(train) > 0) and np.all(np.diff(test) > 0)
    again = split_client(idx, 0.75, seed=1)
    assert np.array_equal(again[0], train)
    assert not np.array_equal(split_client(idx, 0.75, seed=2)[0], train)
    # Small clients: round(0.75 n) but both sides non-empty from n = 2.
    assert [len(s) for s in split_client(np.arange(3))] == [2, 1]  # round(2.25) = 2
    assert [len(s) for s in split_client(np.arange(2))] == [1, 1]  # round(1.5) = 2 -> capped at n-1
    assert [len(s) for s in split_client(np.arange(2), 0.1)] == [1, 1]  # round(0.2) = 0 -> at least 1
    assert [len(s) for s in split_client(np.arange(1))] == [1, 0]
    with pytest.raises(DataError, match="train_fraction"):
        split_client(idx, 1.0)


def test_carve_public() -> None:
    pub = carve_public(LABELS, 7, classes=[4, 1], seed=0)
    assert len(pub) == 14 and np.all(np.diff(pub) > 0)
    assert np.bincount(LABELS[pub], minlength=10).tolist() == [0, 7, 0, 0, 7, 0, 0, 0, 0, 0]
    # The class order given by the caller does not matter.
    assert np.array_equal(carve_public(LABELS, 7, classes=[1, 4], seed=0), pub)
    assert len(carve_public(LABELS, 0, classes=range(10), seed=0)) == 0
    with pytest.raises(DataError, match="class 3 has 100 samples, fewer than the 101"):
        carve_public(LABELS, 101, classes=[3], seed=0)
    with pytest.raises(DataError, match="distinct"):
        carve_public(LABELS, 1, classes=[3, 3], seed=0)


def test_client_min_size_by_hand() -> None:
    # min(2 batches of 64 = 128, pool // (8 N)), floored at 2.
    assert client_min_size(59800, 20) == 128  # 59800 // 160 = 373 -> the 2-batch rule
    assert client_min_size(59800, 50) == 128  # 59800 // 400 = 149
    assert client_min_size(1800, 20) == 11  # 1800 // 160 = 11: small synthetic pool
    assert client_min_size(10, 4) == 2  # 10 // 32 = 0 -> floor 2
    assert client_min_size(1000, 2, min_batches=1, batch_size=32) == 32


def check_federation(labels: np.ndarray, fed, n_clients: int, public_per_class: int, public_classes) -> None:
    n = len(labels)
    assert len(fed.clients) == fed.n_clients == n_clients
    parts = [fed.public] + [c.train for c in fed.clients] + [c.test for c in fed.clients]
    # Public set, client trains and client tests are pairwise disjoint and together cover every sample.
    assert_disjoint_cover(parts, n)
    expected = np.zeros(int(labels.max()) + 1, dtype=int)
    expected[list(public_classes)] = public_per_class
    assert np.bincount(labels[fed.public], minlength=len(expected)).tolist() == expected.tolist()
    pool = n - len(fed.public)
    min_size = client_min_size(pool, n_clients)
    for c in fed.clients:
        size = len(c.train) + len(c.test)
        assert size >= min_size
        assert len(c.train) == round(0.75 * size) or size < 4


def test_build_federation_synthetic() -> None:
    y = make_synthetic(seed=0)[0].y  # 2000 samples
    fed = build_federation(y, n_clients=20, alpha=0.1, seed=0)
    check_federation(y, fed, 20, 20, range(10))
    # Identical for identical arguments (every method gets the same clients).
    again = build_federation(y, n_clients=20, alpha=0.1, seed=0)
    assert np.array_equal(again.public, fed.public)
    for a, b in zip(again.clients, fed.clients, strict=True):
        assert np.array_equal(a.train, b.train) and np.array_equal(a.test, b.test)
    other = build_federation(y, n_clients=20, alpha=0.1, seed=1)
    assert not np.array_equal(other.clients[0].train, fed.clients[0].train)


def test_build_federation_public_options() -> None:
    fed = build_federation(LABELS, n_clients=4, alpha=1.0, seed=0, public_per_class=5, public_classes=[0, 2, 9])
    check_federation(LABELS, fed, 4, 5, [0, 2, 9])
    none = build_federation(LABELS, n_clients=4, alpha=1.0, seed=0, public_per_class=0)
    assert len(none.public) == 0
    check_federation(LABELS, none, 4, 0, [])


def test_build_federation_too_many_clients() -> None:
    with pytest.raises(DataError, match="too few for 600 clients"):
        build_federation(LABELS, n_clients=600, alpha=1.0, seed=0, public_per_class=0)


@pytest.mark.skipif(not os.path.isdir(FASHION_MNIST_DIR), reason=f"Fashion-MNIST not installed at {FASHION_MNIST_DIR}")
def test_build_federation_fashion_mnist_two_batches_per_client() -> None:
    y = load_fashion_mnist()[0].y
    fed = build_federation(y, n_clients=20, alpha=0.1, seed=0)
    check_federation(y, fed, 20, 20, range(10))
    # The full-size rule applies: every client has at least 2 batches of 64.
    assert min(len(c.train) + len(c.test) for c in fed.clients) >= 128


# -- the federation recipe (protofl.data.federation): what the simulator, devices and the server share --


def _recipe_inputs() -> tuple[Dataset, FederationConfig]:
    from protofl.data.federation import limit_train
    from protofl.presets import make_config

    train, _ = make_synthetic(n_train=1200, n_test=10, seed=3)
    return limit_train(train, 1000, 3), make_config("refprotofl", None, seed=3)


def test_federation_recipe_is_pinned() -> None:
    # The partition a (dataset, N, alpha, seed) gets must never drift: reports and devices depend on it.
    # Fingerprint recorded before the recipe moved here from edge_agent/ops/local_data.py (same value then).
    import zlib

    from protofl.data.federation import federation_split

    train, cfg = _recipe_inputs()
    assert len(train) == 1000 and zlib.crc32(train.y.tobytes()) == 2051759731
    split = federation_split(train, 4, 0.5, 3, cfg)
    flat = np.concatenate([split.public] + [np.concatenate([c.train, c.test, [-1]]) for c in split.clients])
    assert zlib.crc32(flat.astype(np.int64).tobytes()) == 2200525030
    assert [len(c) for c in split.clients] == [168, 183, 284, 165]


def test_public_set_is_what_the_partition_keeps_out() -> None:
    from protofl.data.federation import federation_split, limit_train, public_set
    from protofl.errors import ConfigError
    from protofl.presets import make_config

    train, cfg = _recipe_inputs()
    pub = public_set(train, cfg)
    idx = federation_split(train, 4, 0.5, 3, cfg).public
    assert pub is not None and len(idx) == 200
    np.testing.assert_array_equal(pub.x, train.x[idx])
    np.testing.assert_array_equal(pub.y, train.y[idx])
    assert pub.classes == list(range(10))
    # Only ERPA presets ship one; an empty carve ships none.
    assert public_set(train, make_config("fedproto", None, seed=3)) is None
    assert public_set(train, cfg.replace(public_per_class=0)) is None
    assert limit_train(train, None, 0) is train and limit_train(train, 5000, 0) is train
    with pytest.raises(ConfigError, match="--train-limit must be >= 1"):
        limit_train(train, 0, 0)
