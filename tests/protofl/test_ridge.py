"""The ridge predictor's server half (protofl/algorithms/ridge.py) against a hand-computed example, and its fold:
what it adds, what it refuses (and then changes nothing), a device counted once, shards merged."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from broker_server.core.stages import PhaseRun, build_model, check_mergeable
from protofl.algorithms.ridge import (
    RidgeState,
    forget,
    ridge_head,
    ridge_length,
    ridge_solve,
    ridge_statistics,
)
from protofl.errors import ConfigError, WireError
from protofl.mergeable import NotMergeable
from protofl.plan import Phase, RoundPlan, Upload
from protofl.presets import make_config
from protofl.sparse import SparseVector
from protofl.wire import ParamsUpload


def test_statistics_and_solve_match_a_hand_computed_example() -> None:
    # d = 1, C = 2: features 1, 2, 3 with labels 0, 1, 1. [h, 1] = [[1, 1], [2, 1], [3, 1]], so
    # G = [[14, 6], [6, 3]] (upper triangle 14, 6, 3) and B = [h, 1]^T onehot = [[1, 5], [1, 2]].
    v = ridge_statistics(np.array([[1.0], [2.0], [3.0]]), np.array([0, 1, 1]), 2)
    assert v.dtype == np.float32 and v.tolist() == [14, 6, 3, 1, 5, 1, 2]
    assert ridge_length(1, 2) == 7
    # lambda = 0.1 x trace(G) / 2 = 0.85: (G + 0.85 I)^-1 = [[3.85, -6], [-6, 14.85]] / 21.1725, so
    # theta = [[-2.15, 7.25], [8.85, -0.3]] / 21.1725: W = theta[0] as a column per class, b = theta[1].
    w, b = ridge_head(v, 1, 2, 0.1)
    np.testing.assert_allclose(w, [[-2.15 / 21.1725], [7.25 / 21.1725]], rtol=1e-6)
    np.testing.assert_allclose(b, [8.85 / 21.1725, -0.3 / 21.1725], rtol=1e-6)
    # lambda -> 0: least squares of the one-hot targets on h (slopes -0.5 / 0.5, intercepts 4/3 / -1/3)
    g = np.array([[14.0, 6.0], [6.0, 3.0]])
    w0, b0 = ridge_solve(g, np.array([[1.0, 5.0], [1.0, 2.0]]), 1e-12)
    np.testing.assert_allclose(w0, [[-0.5], [0.5]], atol=1e-6)
    np.testing.assert_allclose(b0, [4 / 3, -1 / 3], atol=1e-6)


def test_the_sums_do_not_depend_on_how_the_data_is_split() -> None:
    rng = np.random.default_rng(0)
    h, y = rng.normal(size=(60, 4)), rng.integers(0, 3, 60)
    whole = ridge_statistics(h, y, 3).astype(np.float64)
    parts = np.sum([ridge_statistics(h[i : i + 20], y[i : i + 20], 3).astype(np.float64) for i in (0, 20, 40)], 0)
    np.testing.assert_allclose(parts, whole, rtol=1e-5, atol=1e-4)  # float32 on the wire
    np.testing.assert_allclose(ridge_head(parts, 4, 3)[0], ridge_head(whole, 4, 3)[0], rtol=1e-4, atol=1e-6)


def test_forget_takes_one_devices_statistics_out_exactly() -> None:
    # d = 1, C = 2. Device a: features 1, 2, 3, labels 0, 1, 1 (G = [[14, 6], [6, 3]], B = [[1, 5], [1, 2]], the
    # hand-computed example above: 14, 6, 3, 1, 5, 1, 2); device b: feature 4 with label 0 (G = [[16, 4], [4, 1]],
    # B = [[4, 0], [1, 0]]: 16, 4, 1, 4, 0, 1, 0). Their sums: 30, 10, 4, 5, 5, 2, 2 over 4 samples. Forgetting b
    # leaves a's own statistics, samples 3, and a's head; forgetting a then leaves nothing.
    a = ridge_statistics(np.array([[1.0], [2.0], [3.0]]), np.array([0, 1, 1]), 2)
    b = ridge_statistics(np.array([[4.0]]), np.array([0]), 2)
    assert b.tolist() == [16, 4, 1, 4, 0, 1, 0]
    both = RidgeState(a.astype(np.float64) + b, ["a", "b"], 4)
    assert both.stats is not None and both.stats.tolist() == [30, 10, 4, 5, 5, 2, 2]
    only_a = forget(both, "b", b, 1, 2)
    assert only_a.contributors == ["a"] and only_a.samples == 3
    assert only_a.stats is not None and only_a.stats.tolist() == a.tolist()
    for got, want in zip(ridge_head(only_a.stats, 1, 2), ridge_head(a, 1, 2), strict=True):
        assert np.array_equal(got, want)  # float32 heads, equal: never had b
    gone = forget(only_a, "a", a, 1, 2)
    assert gone.stats is None and gone.contributors == [] and gone.samples == 0
    with pytest.raises(ValueError, match="b contributed no statistics"):
        forget(only_a, "b", b, 1, 2)


def _model(**sets: Any) -> Any:
    cfg = make_config("protofl", proto_dim=4, adapter_rank=2, num_classes=3, **sets)
    return build_model(cfg, RoundPlan.from_config(cfg))


def _upload(h: np.ndarray, y: np.ndarray) -> ParamsUpload:
    return ParamsUpload(update=ridge_statistics(h, y, 3), n_samples=len(y), base_round=1)


def test_the_protofl_preset_runs_it_and_it_stands_aside_where_a_model_is_federated() -> None:
    cfg = make_config("protofl")
    assert "ridge" in cfg.techniques and RoundPlan.from_config(cfg).shared_backbone
    assert RoundPlan.from_config(cfg).sends(Phase.TRAIN) == (Upload.PROTOS, Upload.ADAPTER)
    for cfg in (make_config("fedavg", ridge=True), make_config("protofl", federate="adapter")):
        assert "ridge" not in cfg.techniques and not RoundPlan.from_config(cfg).shared_backbone
    with pytest.raises(ConfigError, match="ridge_lambda must be > 0"):
        make_config("protofl", ridge_lambda=0)


def test_the_fold_sums_counts_each_device_once_and_refuses_bad_statistics() -> None:
    m = _model()
    rng = np.random.default_rng(1)
    h1, y1, h2, y2 = rng.normal(size=(10, 4)), rng.integers(0, 3, 10), rng.normal(size=(7, 4)), rng.integers(0, 3, 7)
    run = PhaseRun(m, Phase.TRAIN)
    run.add(Upload.ADAPTER, _upload(h1, y1), "dev-1")
    # dev-2's upload is an asynchronous round's older one, weighted 1/sqrt(1+1): its statistics of its data are
    # checked against the count it sent (7), not the weighted one (4.95), and folded as sent
    run.add(Upload.ADAPTER, _upload(h2, y2), "dev-2", weight=1 / np.sqrt(2))
    bad = ridge_statistics(h1, y1, 3)
    bad[0] = -1.0  # G's first diagonal entry: not a sum of squares
    with pytest.raises(WireError, match="negative diagonal"):
        run.add(Upload.ADAPTER, ParamsUpload(update=bad, n_samples=10, base_round=1), "dev-3")
    with pytest.raises(WireError, match="count 10 samples, the upload says 9"):
        run.add(Upload.ADAPTER, ParamsUpload(update=ridge_statistics(h1, y1, 3), n_samples=9, base_round=1), "dev-3")
    with pytest.raises(WireError, match="length 5, expected"):
        run.add(Upload.ADAPTER, ParamsUpload(update=np.ones(5, np.float32), n_samples=9, base_round=1), "dev-3")
    run.finish()
    state = m.rules.state(RidgeState)
    assert state.contributors == ["dev-1", "dev-2"] and state.samples == 17
    both = np.vstack([h1, h2]), np.concatenate([y1, y2])
    want = ridge_head(ridge_statistics(*both, 3).astype(np.float64), 4, 3)
    got = m.rules.predictor_head()
    assert got is not None
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-6)
    # The next round: dev-1 sends its statistics again (it lost its state), dev-2 sends them empty: nothing added.
    run = PhaseRun(m, Phase.TRAIN)
    run.add(Upload.ADAPTER, _upload(h1, y1), "dev-1")
    empty = SparseVector(ridge_length(4, 3), np.zeros(0, np.int64), np.zeros(0, np.float32))
    run.add(Upload.ADAPTER, ParamsUpload(update=empty, n_samples=7, base_round=2), "dev-2")
    run.finish()
    assert state.contributors == ["dev-1", "dev-2"] and state.samples == 17


def test_shards_merge_to_the_same_sums() -> None:
    rng = np.random.default_rng(2)
    ups = [(f"dev-{i}", rng.normal(size=(5, 4)), rng.integers(0, 3, 5)) for i in range(4)]
    one, a, b = _model(), _model(), _model()
    run1, ra, rb = PhaseRun(one, Phase.TRAIN), PhaseRun(a, Phase.TRAIN), PhaseRun(b, Phase.TRAIN)
    for i, (who, h, y) in enumerate(ups):
        run1.add(Upload.ADAPTER, _upload(h, y), who)
        (ra if i % 2 else rb).add(Upload.ADAPTER, _upload(h, y), who)
    fa, fb = ra.folds[-1], rb.folds[-1]
    with pytest.raises(ValueError, match="senders"):
        fa.merge({**fb.partial(), "senders": [1]})
    fa.merge(fb.partial())
    run1.finish()
    ra.finish()
    s1, sa = one.rules.state(RidgeState), a.rules.state(RidgeState)
    assert sorted(s1.contributors) == sorted(sa.contributors) and s1.samples == sa.samples == 20
    assert s1.stats is not None and sa.stats is not None
    np.testing.assert_allclose(sa.stats, s1.stats, rtol=1e-12)
    with pytest.raises(NotMergeable, match="drop --shards, or turn the route off with --set ridge_topk=0"):
        check_mergeable(make_config("protofl", ridge_topk=0.001))  # the opt-in route runs on one aggregator
    check_mergeable(make_config("protofl"))  # the default: the one-shot predictor merges across shards
