"""The ridge predictor's route, server half (protofl/algorithms/ridge.py), against hand-computed examples: two devices'
sparse updates averaged with their sample counts and applied to g, the round message's change of g, a statistics
round whose fresh head replaces g's (from that round's sums only), a device behind that gets all of g, and bad
uploads refused with a reason, changing nothing."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from broker_server.core.stages import PhaseRun, ServerModel, build_model
from protofl.algorithms.ridge import (
    RidgeState,
    head_slice,
    is_stats_round,
    ridge_head,
    ridge_length,
    ridge_statistics,
    route_k,
    route_on,
    select_topk,
)
from protofl.errors import ConfigError, WireError
from protofl.plan import Phase, RoundPlan, Upload
from protofl.presets import make_config
from protofl.sparse import SparseVector
from protofl.wire import ModelUpdate, ParamsUpload, RoundStart, decode_message, encode_message

D, C, L = 4, 3, 20  # features, classes, g's length: 5 body values, then the head's 3 x 4 + 3 = 15
BACKBONE = np.arange(L, dtype=np.float32) / 10  # g_0: 0.0, 0.1, ..., 1.9


def _model(**sets: Any) -> ServerModel:
    cfg = make_config("protofl", proto_dim=D, adapter_rank=2, num_classes=C, ridge_topk=0.1, ridge_every=3, **sets)
    return build_model(cfg, RoundPlan.from_config(cfg), shared_backbone=BACKBONE)


def _run(m: ServerModel, round_: int) -> PhaseRun:
    m.round = round_
    return PhaseRun(m, Phase.TRAIN)


def _sparse(idx: list[int], values: list[float], n: int = L) -> SparseVector:
    return SparseVector(n, np.array(idx, np.int64), np.array(values, np.float32))


def _update(idx: list[int], values: list[float], n_samples: int, round_: int) -> ParamsUpload:
    return ParamsUpload(update=_sparse(idx, values), n_samples=n_samples, base_round=round_)


def _stats(seed: int, n: int) -> tuple[np.ndarray, np.ndarray, ParamsUpload]:
    rng = np.random.default_rng(seed)
    h, y = rng.normal(size=(n, D)), rng.integers(0, C, n)
    return h, y, ParamsUpload(update=ridge_statistics(h, y, C), n_samples=n, base_round=1)


def test_rounds_topk_and_head_layout() -> None:
    # T = 10: statistics in rounds 1, 11, 21, 31, 41 (5 of 50 rounds); T = 0: only round 1
    assert [r for r in range(1, 51) if is_stats_round(r, 10)] == [1, 11, 21, 31, 41]
    assert [r for r in range(1, 30) if is_stats_round(r, 0)] == [1]
    assert route_k(1_696_682, 0.001) == 1697 and route_k(20, 0.1) == 2 and route_k(5, 0.001) == 1
    assert head_slice(L, D, C) == slice(5, 20)
    # top-2 of |[0.5, -3, 3, 1]|: entries 1 and 2 (the tie at 3 is both); of |[1, -1, 1]|: the lower indices 0, 1
    sv = select_topk(np.array([0.5, -3.0, 3.0, 1.0], np.float32), 2)
    assert sv.indices.tolist() == [1, 2] and sv.values.tolist() == [-3.0, 3.0]
    assert select_topk(np.array([1.0, -1.0, 1.0], np.float32), 2).indices.tolist() == [0, 1]


def test_two_devices_updates_are_averaged_by_samples_applied_and_shipped() -> None:
    m = _model()
    st = m.rules.state(RidgeState)
    assert st.g is not None and st.g_version == 0 and np.array_equal(st.g, BACKBONE)
    # Round 1: statistics of two devices; g's head (its last 15 values) becomes their solve: version 1.
    h1, y1, s1 = _stats(1, 10)
    h2, y2, s2 = _stats(2, 30)
    run = _run(m, 1)
    run.add(Upload.ADAPTER, s1, "dev-1")
    run.add(Upload.ADAPTER, s2, "dev-2")
    run.finish()
    w, b = ridge_head(ridge_statistics(np.vstack([h1, h2]), np.concatenate([y1, y2]), C).astype(np.float64), D, C)
    g1 = st.g.copy()
    assert st.g_version == 1 and np.array_equal(g1[:5], BACKBONE[:5])
    np.testing.assert_allclose(g1[5:], np.concatenate([w.ravel(), b]), rtol=1e-4, atol=1e-6)
    assert st.g_changed.tolist() == list(range(5, 20))
    head = m.rules.predictor_head()
    assert head is not None and np.array_equal(head[0].ravel(), g1[5:17]) and np.array_equal(head[1], g1[17:])
    # Round 2 (an update round): dev-1 (10 samples) sends {0: 1, 7: 2}, dev-2 (30 samples) {0: -1, 3: 4}. The mean,
    # an absent entry counting 0: entry 0 (10 x 1 + 30 x -1) / 40 = -0.5, entry 3 30 x 4 / 40 = 3, entry 7
    # 10 x 2 / 40 = 0.5; added to g in float64, stored float32.
    run = _run(m, 2)
    run.add(Upload.ADAPTER, _update([0, 7], [1.0, 2.0], 10, 2), "dev-1")
    run.add(Upload.ADAPTER, _update([0, 3], [-1.0, 4.0], 30, 2), "dev-2")
    run.finish()
    want = g1.copy()
    want[[0, 3, 7]] = (g1[[0, 3, 7]].astype(np.float64) + [-0.5, 3.0, 0.5]).astype(np.float32)
    assert st.g_version == 2 and np.array_equal(st.g, want)
    assert want[0] == np.float32(-0.5) and want[3] == np.float32(3.3)  # 0.0 - 0.5 and 0.3 + 3 (float32)
    # The next round message carries g's new values at the union of the indices: a device holding version 1 sets
    # them and holds version 2 bit for bit; through the wire and back.
    fields = m.rules.round_fields(Phase.TRAIN)
    assert fields.model is not None and fields.model.version == 2 and fields.model.dense is None
    msg = RoundStart(deadline=1.0, model=fields.model)
    back = decode_message(encode_message(msg, fed="f", sender="server", round=3, phase="train"))[1]
    assert isinstance(back, RoundStart) and back.model is not None
    assert back.model.update.indices.tolist() == [0, 3, 7]
    device_g = g1.copy()
    device_g[back.model.update.indices] = back.model.update.values
    assert device_g.tobytes() == st.g.tobytes()
    # The final round message carries it too, and the head.
    final = m.rules.round_fields(Phase.DONE)
    assert final.model is not None and final.model.version == 2 and final.predictor is not None
    assert m.rules.predictor_backbone() is st.g


def test_a_device_behind_gets_all_of_g_and_a_statistics_round_replaces_the_head_from_its_own_sums() -> None:
    m = _model()
    st = m.rules.state(RidgeState)
    run = _run(m, 1)
    run.add(Upload.ADAPTER, _stats(1, 10)[2], "dev-1")
    run.finish()
    # Round 2: dev-1 sends an update; dev-2 holds another version of g: it sends an empty one. Nothing of dev-2's
    # is added (the mean is dev-1's alone), and the next round message carries the whole g.
    run = _run(m, 2)
    run.add(Upload.ADAPTER, _update([1], [2.0], 10, 2), "dev-1")
    run.add(Upload.ADAPTER, _update([], [], 30, 2), "dev-2")
    run.finish()
    assert st.g is not None and st.g[1] == np.float32(0.1 + 2.0) and st.g_resync
    fields = m.rules.round_fields(Phase.TRAIN)
    assert fields.model is not None and fields.model.dense is not None
    assert fields.model.dense.tobytes() == st.g.tobytes()
    # Round 3: nobody behind: the next message is lean again.
    run = _run(m, 3)
    run.add(Upload.ADAPTER, _update([2], [1.0], 10, 3), "dev-1")
    run.finish()
    lean = m.rules.round_fields(Phase.TRAIN).model
    assert not st.g_resync and lean is not None and lean.dense is None
    # Round 4 (every = 3: rounds 1, 4, 7 send statistics): one device's statistics of g's current backbone. The head
    # is solved from this round's sums only -- round 1's statistics (another version of g) are not added.
    before = st.g.copy()
    h3, y3, s3 = _stats(3, 12)
    run = _run(m, 4)
    run.add(Upload.ADAPTER, s3, "dev-2")
    run.finish()
    w, b = ridge_head(ridge_statistics(h3, y3, C).astype(np.float64), D, C)
    np.testing.assert_allclose(st.g[5:], np.concatenate([w.ravel(), b]), rtol=1e-4, atol=1e-6)
    assert np.array_equal(st.g[:5], before[:5]) and st.contributors == ["dev-2"] and st.samples == 12


def test_bad_uploads_are_refused_with_a_reason_and_change_nothing() -> None:
    m = _model()
    st = m.rules.state(RidgeState)
    run = _run(m, 1)
    h, y, s1 = _stats(1, 10)
    # Round 1 is a statistics round: an update of g's length is refused, saying so.
    with pytest.raises(WireError, match="round 1 is a statistics round"):
        run.add(Upload.ADAPTER, _update([0], [1.0], 10, 1), "dev-1")
    run.add(Upload.ADAPTER, s1, "dev-1")
    run.finish()
    g1, version = st.g.copy(), st.g_version  # type: ignore[union-attr]
    run = _run(m, 2)
    nan = _update([0], [1.0], 10, 2)
    object.__setattr__(nan, "update", _sparse([0], [float("nan")]))  # (the decoder refuses NaN: a fold does too)
    out_of_range = _update([0], [1.0], 10, 2)
    object.__setattr__(out_of_range, "update", SparseVector(L, np.array([L + 3]), np.array([1.0], np.float32)))
    bad = [
        (ParamsUpload(update=ridge_statistics(h, y, C), n_samples=10, base_round=2), "round 2 is an update round"),
        (ParamsUpload(update=_sparse([0], [1.0], n=L + 1), n_samples=10, base_round=2), "expected g's 20 values"),
        (ParamsUpload(update=np.ones(L, np.float32), n_samples=10, base_round=2), "sent dense"),
        (_update([0, 1, 2], [1.0, 1.0, 1.0], 10, 2), r"at most K = 2"),
        (nan, "not finite"),
        (out_of_range, "in range"),
    ]
    for up, why in bad:
        with pytest.raises(WireError, match=why):
            run.add(Upload.ADAPTER, up, "dev-2")
    assert not run.folds[-1].senders and not run.folds[-1].num.any()  # type: ignore[attr-defined]
    run.finish()
    assert st.g is not None and st.g_version == version and np.array_equal(st.g, g1)  # nothing changed
    # On the wire: indices out of range or NaN values do not even decode into an upload.
    with pytest.raises(WireError, match=r"in \[0, 20\)"):
        ParamsUpload(update=SparseVector(L, np.array([L]), np.array([1.0], np.float32)), n_samples=1, base_round=2)
    with pytest.raises(WireError):
        ParamsUpload(update=_sparse([0], [float("nan")]), n_samples=1, base_round=2)
    with pytest.raises(WireError, match="finite float32"):
        ModelUpdate(version=1, update=_sparse([0], [float("inf")]))


def test_combinations_the_route_does_not_take_are_refused_with_the_option_that_turns_it_off() -> None:
    with pytest.raises(ConfigError, match="buffered asynchronous") as err:
        make_config("protofl", buffer_k=2, ridge_topk=0.001)
    assert "--set ridge_topk=0" in str(err.value)
    make_config("protofl", buffer_k=2)  # the default (the route off): the one-shot predictor combines as it did
    assert not route_on(make_config("protofl"))  # off by default: an opt-in (docs/algorithms.md "The route")
    with pytest.raises(ConfigError, match="secagg: secure aggregation covers"):  # any vector beside prototypes
        make_config("protofl", secagg=True, ridge_topk=0.001)
    with pytest.raises(ConfigError, match="ridge=false"):  # DP: any parameter upload, the statistics too
        make_config("protofl", dp_epsilon=8.0, ridge_topk=0.001)
    with pytest.raises(ConfigError, match=r"ridge_topk must be in \[0, 1\)"):
        make_config("protofl", ridge_topk=1.5)
    # Old configs: without a shared backbone on the server the route stays off (the one-shot predictor).
    cfg = make_config("protofl", proto_dim=D, adapter_rank=2, num_classes=C, ridge_topk=0.001)
    m = build_model(cfg, RoundPlan.from_config(cfg))
    assert m.rules.state(RidgeState).g is None and m.rules.round_fields(Phase.TRAIN).model is None
    assert ridge_length(D, C) == 30
