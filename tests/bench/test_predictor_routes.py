"""bench.predictor_routes, the pieces that do not train: byte accounting against the real wire encoder, the
numpy server steps (distillation, ensemble targets, ridge, nearest prototype) against hand examples, the
project's data recipe, and the selection rule on fake rows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench import predictor_routes as pr


# -- bytes ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 15, 16, 255, 256, 5130, 65535, 65536, 1_696_682])
def test_params_upload_bytes_are_the_encoded_message(n: int) -> None:
    from protofl.wire import ParamsUpload, message_size

    for n_samples, rnd in ((5, 1), (1051, 7), (70000, 300)):
        msg = ParamsUpload(update=np.zeros(n, np.float32), n_samples=n_samples, base_round=rnd)
        real = message_size(msg, fed="sim", sender="client-003", round=rnd, phase="train", msg_id="0" * 16)
        assert pr.params_upload_bytes(n, n_samples, rnd, sender="client-003") == real


@pytest.mark.parametrize("k", [0, 1, 3, 10, 16])
def test_proto_upload_bytes_are_the_encoded_message(k: int) -> None:
    from protofl.wire import ProtoSet, ProtoUpload, message_size

    for counts in (True, False):
        ps = ProtoSet(
            classes=np.arange(k), values=np.zeros((k, 512), np.float32), counts=np.full(k, 40) if counts else None
        )
        msg = ProtoUpload(local=ps, public=None, n_samples=777)
        real = message_size(msg, fed="sim", sender="client-000", round=2, phase="train", msg_id="0" * 16)
        assert pr.proto_upload_bytes(k, 512, 777, 2, counts=counts) == real


@pytest.mark.parametrize("n,k", [(1000, 4), (1000, 300), (70000, 280), (70000, 20000), (1_696_682, 6787)])
def test_sparse_upload_bytes_are_the_encoded_message(n: int, k: int) -> None:
    from protofl.sparse import SparseVector
    from protofl.wire import ParamsUpload, message_size

    idx = np.sort(np.random.default_rng(0).choice(n, size=k, replace=False))
    msg = ParamsUpload(update=SparseVector(n, idx, np.ones(k, np.float32)), n_samples=4350, base_round=12)
    real = message_size(msg, fed="sim", sender="client-009", round=12, phase="train", msg_id="0" * 16)
    assert pr.sparse_upload_bytes(n, k, 4350, 12, sender="client-009") == real


def test_topk_count_is_apuds_budget() -> None:
    from protofl.algorithms.apud import topk_budget

    for d in (1, 30, 250, 1_696_682, 11_173_962):
        for ratio in (0.004, 0.1, 1.0):
            assert pr.topk_count(d, ratio) == topk_budget(d, ratio)


def test_route_uplink_counts_each_route_upload_by_upload() -> None:
    kw: dict[str, Any] = dict(
        sizes=[300, 1200],
        classes_held=[3, 10],
        rounds=4,
        full_params=1000,
        dim=8,
        head_params=90,
        adapter_params=50,
        public_n=200,
        num_classes=10,
    )
    p, q = pr.params_upload_bytes, pr.proto_upload_bytes
    senders = ["client-000", "client-001"]
    fed = sum(p(1000, n, r, sender=s) for n, s in zip([300, 1200], senders, strict=True) for r in range(1, 5))
    assert pr.route_uplink("fedavg", **kw) == fed
    protos = q(3, 8, 300, 1, sender="client-000") + q(10, 8, 1200, 1, sender="client-001")
    assert pr.route_uplink("proto-l2", **kw) == pr.route_uplink("proto-cos", **kw) == protos
    heads = sum(p(90, n, r, sender=s) for n, s in zip([300, 1200], senders, strict=True) for r in range(1, 5))
    assert pr.route_uplink("head", **kw) == heads
    assert pr.route_uplink("head-ncm", **kw) == heads + protos
    ridge = sum(p(pr.ridge_values(8, 10), n, 1, sender=s) for n, s in zip([300, 1200], senders, strict=True))
    assert pr.ridge_values(8, 10) == 9 * 10 // 2 + 9 * 10  # upper triangle of 9 x 9, and 9 x 10
    assert pr.route_uplink("ridge", **kw) == ridge
    assert pr.route_uplink("head-ridge", **kw) == ridge + heads
    assert pr.route_uplink("adapter-head", **kw) == sum(
        p(140, n, r, sender=s) + q(k, 8, n, r, sender=s)
        for n, k, s in zip([300, 1200], [3, 10], senders, strict=True)
        for r in range(1, 5)
    )
    assert pr.route_uplink("distil-mean", **kw) == sum(
        p(2000, n, 4, sender=s) for n, s in zip([300, 1200], senders, strict=True)
    )
    assert pr.route_uplink("distil-counts", **kw) == sum(
        p(2010, n, 4, sender=s) for n, s in zip([300, 1200], senders, strict=True)
    )
    k = pr.topk_count(1000)
    assert k == 4
    assert pr.route_uplink("topk-ef", **kw) == sum(
        pr.sparse_upload_bytes(1000, 4, n, r, sender=s)
        for n, s in zip([300, 1200], senders, strict=True)
        for r in range(1, 5)
    )
    for control in ("public", "local", "local-public", "ensemble-public"):
        assert pr.route_uplink(control, **kw) == 0
    with pytest.raises(ValueError, match="unknown route"):
        pr.route_uplink("nope", **kw)


def test_the_cnn_fedavg_upload_is_tables_size() -> None:
    """TABLE.md's FedAvg rows: 6,786,889 B per client per round for the cnn (1,696,682 values); that figure is
    the run's whole uplink over clients x rounds, so it may hold a few more bytes than the one upload."""
    from edge_agent.training.models import build_model

    m = build_model("cnn", (1, 28, 28), 10, 512, 32, seed=0)
    n = sum(t.numel() for t in m.state_dict().values() if t.is_floating_point())
    assert n == 1_696_682
    assert 0 <= 6_786_889 - pr.params_upload_bytes(n, 435, 5) < 50


# -- server steps ----------------------------------------------------------------------------------------
def test_distil_one_gradient_step_by_hand() -> None:
    # phi = I (2 samples, 2 dims), one-hot targets, head at 0: p = (1/2, 1/2) for both samples;
    # grad_W = (P - T)^T phi / n = [[-1/2, 1/2], [1/2, -1/2]] / 2, grad_b = mean(P - T) = 0.
    w, b = pr.distil_head(
        np.eye(2), np.eye(2), np.zeros((2, 2)), np.zeros(2), steps=1, weight_decay=0.0, lr=1.0, nesterov=False
    )
    np.testing.assert_allclose(w, [[0.25, -0.25], [-0.25, 0.25]], atol=1e-7)
    np.testing.assert_allclose(b, [0.0, 0.0], atol=1e-7)
    # weight decay acts on W, not on b: from W0 = I, b0 = (1, 0), lr 1, wd 0.5, targets = the head's own
    # probabilities (zero data gradient): W1 = W0 - 0.5 W0, b1 = b0
    phi = np.array([[1.0, 0.0], [0.0, 1.0]])
    t = pr._softmax(phi @ np.eye(2).T + np.array([1.0, 0.0]))
    w, b = pr.distil_head(phi, t, np.eye(2), np.array([1.0, 0.0]), steps=1, weight_decay=0.5, lr=1.0, nesterov=False)
    np.testing.assert_allclose(w, 0.5 * np.eye(2), atol=1e-7)
    np.testing.assert_allclose(b, [1.0, 0.0], atol=1e-7)


def test_distil_fits_realisable_targets() -> None:
    rng = np.random.default_rng(0)
    phi = rng.normal(size=(200, 6))
    w_true, b_true = rng.normal(size=(4, 6)), rng.normal(size=4)
    t = pr._softmax(phi @ w_true.T + b_true)
    w, b = pr.distil_head(phi, t, np.zeros((4, 6)), np.zeros(4), steps=3000, weight_decay=0.0)
    p = pr._softmax(phi @ w.T.astype(np.float64) + b)
    assert np.abs(p - t).max() < 0.02
    assert (p.argmax(1) == t.argmax(1)).mean() > 0.97


def test_ensemble_targets_by_hand() -> None:
    # 2 devices, 1 public image, 2 classes; device 0 holds only class 0 (n = 10, 0), device 1 both (10, 30)
    probs = np.array([[[0.9, 0.1]], [[0.2, 0.8]]])
    np.testing.assert_allclose(pr.ensemble_targets(probs), [[0.55, 0.45]])
    # class 0: weights 10/20, 10/20 -> 0.5*0.9 + 0.5*0.2 = 0.55; class 1: 0/30, 30/30 -> 0.8; renormalised
    t = pr.ensemble_targets(probs, np.array([[10, 0], [10, 30]]))
    np.testing.assert_allclose(t, [[0.55 / 1.35, 0.8 / 1.35]])
    # a class nobody holds: uniform weights
    t = pr.ensemble_targets(probs, np.array([[10, 0], [30, 0]]))
    np.testing.assert_allclose(t, [[(0.25 * 0.9 + 0.75 * 0.2) / (0.375 + 0.45), 0.45 / (0.375 + 0.45)]])


def test_nearest_prototype_l2_and_cosine_by_hand() -> None:
    protos = {0: np.array([1.0, 0.0], np.float32), 2: np.array([4.0, 4.0], np.float32)}
    z = np.array([[1.2, 0.1], [3.0, 3.5], [2.0, 2.0], [0.5, 0.5]], np.float32)
    # L2: (1.2,0.1) -> 0; (3,3.5) -> 2; (2,2): |.-g0|^2 = 5, |.-g2|^2 = 8 -> 0; (0.5,0.5) -> 0
    np.testing.assert_array_equal(pr.nearest_l2(z, protos), [0, 2, 0, 0])
    # cosine: (2,2) and (0.5,0.5) point along g2 -> 2; (1.2,0.1) -> 0
    np.testing.assert_array_equal(pr.nearest_cos(z, protos), [0, 2, 2, 2])
    # ties go to the lower class id
    np.testing.assert_array_equal(pr.nearest_cos(np.array([[1.0, 0.0]]), {1: np.ones(2), 3: np.array([2.0, 0])}), [3])
    np.testing.assert_array_equal(
        pr.nearest_l2(np.array([[0.0, 0.0]]), {1: np.array([1.0, 0]), 3: np.array([0, 1.0])}), [1]
    )


def test_ncm_head_is_the_nearest_prototype_rule_with_the_asked_margin() -> None:
    rng = np.random.default_rng(1)
    protos = {c: rng.normal(size=8).astype(np.float32) * 5 for c in (0, 1, 3, 4)}
    z = rng.normal(size=(500, 8)) * 5
    w, b = pr.ncm_head(protos, 5, 8, margin=4.0)
    np.testing.assert_array_equal(pr.head_predict(z, w, b), pr.nearest_l2(z, protos))
    assert b[2] == -1e4 and not w[2].any()  # a class with no prototype is never chosen
    g = np.stack([protos[c] for c in (0, 1, 3, 4)]).astype(np.float64)
    logits = g @ w[[0, 1, 3, 4]].T.astype(np.float64) + b[[0, 1, 3, 4]]
    gaps = np.diag(logits)[:, None] - logits  # lead of the own class at each prototype
    off = ~np.eye(4, dtype=bool)
    assert gaps[off].min() > 0
    assert gaps[off].mean() == pytest.approx(4.0, rel=1e-4)


def test_ridge_by_hand_and_additive_over_devices() -> None:
    # h = (1), (2), labels 0, 1: [h,1] = [[1,1],[2,1]], G = [[5,3],[3,2]], B = [[1,2],[1,1]],
    # theta = G^-1 B = [[2,-3],[-3,5]] B = [[-1,1],[2,-1]]: W = [[-1],[1]], b = (2, -1)
    h, y = np.array([[1.0], [2.0]]), np.array([0, 1])
    g, bb = pr.ridge_stats(h, y, 2)
    np.testing.assert_allclose(g, [[5, 3], [3, 2]])
    np.testing.assert_allclose(bb, [[1, 2], [1, 1]])
    w, b = pr.ridge_solve(g, bb, lam_rel=0.0)
    np.testing.assert_allclose(w, [[-1], [1]], atol=1e-6)
    np.testing.assert_allclose(b, [2, -1], atol=1e-6)
    np.testing.assert_array_equal(pr.head_predict(h, w, b), y)
    # lambda = lam_rel x mean diagonal: 0.1 x 3.5 = 0.35 on the diagonal
    w2, b2 = pr.ridge_solve(g, bb, lam_rel=0.1)
    theta = np.linalg.solve(g + 0.35 * np.eye(2), bb)
    np.testing.assert_allclose(np.vstack([w2.T, b2]), theta, rtol=1e-6)
    # the sum of devices' statistics is the union's
    rng = np.random.default_rng(2)
    ha, ya = rng.normal(size=(30, 4)), rng.integers(0, 3, 30)
    g1, b1 = pr.ridge_stats(ha[:10], ya[:10], 3)
    g2, b2_ = pr.ridge_stats(ha[10:], ya[10:], 3)
    gu, bu = pr.ridge_stats(ha, ya, 3)
    np.testing.assert_allclose(g1 + g2, gu)
    np.testing.assert_allclose(b1 + b2_, bu)


def test_prototype_math_without_the_project_modules_is_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(3)
    ups_data = [(rng.normal(size=(40, 6)).astype(np.float32), rng.integers(0, 4, 40)) for _ in range(3)]
    z = rng.normal(size=(50, 6)).astype(np.float32)
    ours = [pr.class_means(x, y, 5) for x, y in ups_data]
    g = pr.global_prototypes(ours, 5, 6)
    pred = pr.nearest_l2(z, g)
    monkeypatch.setattr(pr, "_project_protos", lambda: None)
    twin = [pr.class_means(x, y, 5) for x, y in ups_data]
    for (p1, c1), (p2, c2) in zip(ours, twin, strict=True):
        assert c1 == c2 and p1.keys() == p2.keys()
        for c in p1:
            np.testing.assert_allclose(p1[c], p2[c], rtol=1e-6)
    g2 = pr.global_prototypes(twin, 5, 6)
    assert g.keys() == g2.keys() == {0, 1, 2, 3}
    for c in g:
        np.testing.assert_allclose(g[c], g2[c], rtol=1e-6)
    np.testing.assert_array_equal(pr.nearest_l2(z, g2), pred)


# -- the project's data recipe ---------------------------------------------------------------------------
def test_the_federation_is_the_simulators() -> None:
    from types import SimpleNamespace

    from protofl.config import CORE
    from protofl.data import make_synthetic
    from protofl.data.federation import federation_split, limit_train

    # the config defaults federation_split reads (every preset leaves them alone); a namespace stands for the
    # config so that the technique registry (whatever else is installed beside this checkout) stays out of it
    cfg = SimpleNamespace(
        public_per_class=CORE["public_per_class"], public_classes=CORE["public_classes"], batch_size=CORE["batch_size"]
    )
    assert (cfg.public_per_class, cfg.public_classes, cfg.batch_size) == (pr.PUBLIC_PER_CLASS, None, pr.BATCH)

    train, _ = make_synthetic(num_classes=10, n_train=3000, n_test=10, seed=5)
    for limit in (None, 1500):
        for seed in (0, 3):
            ours = limit_train_subset = train.subset(pr.limit_train_idx(len(train), limit, seed))
            theirs = limit_train(train, limit, seed)
            np.testing.assert_array_equal(ours.y, theirs.y)
            np.testing.assert_array_equal(limit_train_subset.x, theirs.x)
            a = pr.federation(ours.y, 4, 0.5, seed)
            b = federation_split(theirs, 4, 0.5, seed, cfg)  # type: ignore[arg-type]
            np.testing.assert_array_equal(a.public, b.public)
            assert len(a.public) == 200
            for ca, cb in zip(a.clients, b.clients, strict=True):
                np.testing.assert_array_equal(ca.train, cb.train)
                np.testing.assert_array_equal(ca.test, cb.test)


# -- the rule ----------------------------------------------------------------------------------------------
def _rows(route: str, accs: list[float], ratio: float | None, total: float = 1e5) -> list[dict]:
    return [
        {
            "route": route,
            "seed": s,
            "acc": a,
            "uplink_total": total,
            "uplink_ratio": ratio,
            "uplink_per_client_round": total / 100,
            "complete": True,
        }
        for s, a in enumerate(accs)
    ]


FEDAVG = [80.0, 81.0, 79.0, 80.5, 79.5]
PUBLIC = [75.0, 76.0, 74.0, 75.5, 74.5]


def test_rule_picks_the_fewest_bytes_among_those_the_best_does_not_beat() -> None:
    rows = (
        _rows("fedavg", FEDAVG, 1.0, 1e9)
        + _rows("public", PUBLIC, None, 0)
        + _rows("ridge", [80.0, 81.2, 79.1, 80.4, 79.6], 0.002, 5e5)  # ~ FedAvg, beats public
        + _rows("head", [80.2, 81.0, 79.3, 80.3, 79.9], 0.004, 1e6)  # best mean, ties ridge
        + _rows("proto-l2", [76.0, 77.5, 75.0, 76.0, 75.5], 0.0001, 1e4)  # beats public, not near FedAvg
        + _rows("adapter-head", [82.0, 83.0, 81.0, 82.5, 81.5], 0.03, 3e7)  # best, but too many bytes
        + _rows("distil-mean", [75.1, 75.9, 74.1, 75.4, 74.6], 0.00001, 1e3)
    )  # only matches public
    dec = pr.select(rows)
    c = dec["checks"]
    assert dec["decided"]
    assert c["ridge"]["qualifies"] and c["head"]["qualifies"]
    assert not c["adapter-head"]["bytes_ok"] and c["adapter-head"]["near_fedavg"]
    assert c["proto-l2"]["bytes_ok"] and c["proto-l2"]["beats_public"] and not c["proto-l2"]["near_fedavg"]
    assert not c["distil-mean"]["beats_public"]
    assert dec["default"] == "ridge"  # head has the best mean but does not beat ridge; ridge sends fewer bytes


def test_rule_keeps_the_best_when_it_beats_the_cheaper_ones() -> None:
    rows = (
        _rows("fedavg", FEDAVG, 1.0, 1e9)
        + _rows("public", PUBLIC, None, 0)
        + _rows("ridge", [79.0, 80.1, 78.0, 79.6, 78.4], 0.002, 5e5)
        + _rows("head", [80.0, 81.0, 79.0, 80.5, 79.5], 0.004, 1e6)
    )  # head - ridge = +1.0 every seed
    dec = pr.select(rows)
    assert dec["default"] == "head"


def test_rule_without_a_qualifier_names_a_provisional_default() -> None:
    rows = (
        _rows("fedavg", FEDAVG, 1.0, 1e9)
        + _rows("public", PUBLIC, None, 0)
        + _rows("proto-l2", [76.0, 77.5, 75.0, 76.0, 75.5], 0.0001, 1e4)
        + _rows("ridge", [77.0, 78.2, 76.1, 77.4, 76.6], 0.002, 5e5)
        + _rows("head", [70.0, 71.0, 69.0, 70.5, 69.5], 0.004, 1e6)
    )
    dec = pr.select(rows)
    assert dec["default"] is None and dec["provisional"] == "ridge"
    assert "moonshot missed" in dec["why"]
    rows = _rows("fedavg", FEDAVG, 1.0, 1e9) + _rows("public", PUBLIC, None, 0) + _rows("head", PUBLIC, 0.5, 1e8)
    dec = pr.select(rows)
    assert dec["default"] is None and dec["provisional"] is None


def test_rule_on_one_seed_is_a_reading_of_the_means() -> None:
    rows = (
        _rows("fedavg", [89.0], 1.0, 1e9)
        + _rows("public", [80.0], None, 0)
        + _rows("ridge", [88.0], 0.001, 1e6)
        + _rows("head", [88.5], 0.002, 2e6)
    )
    dec = pr.select(rows)
    assert not dec["decided"] and dec["default"] == "head"
    assert "not a decision" in dec["why"]
    assert pr.select(_rows("ridge", [88.0], 0.001))["why"].startswith("FedAvg's and the public-only")


def test_converged_at_is_the_issues_stopping_rule() -> None:
    curve = [[r, a] for r, a in enumerate([50, 60, 65, 68, 70, 71, 71.5, 71.8, 72.0, 72.1, 72.15], start=1)]
    # acc(r) - acc(r-5): r=6: 21, r=7: 11.5, r=8: 6.8, r=9: 4, r=10: 2.1, r=11: 1.15 -> never < 0.2
    assert pr.converged_at(curve) is None
    curve += [[12, 72.2], [13, 72.2], [14, 72.25], [15, 72.3], [16, 72.3]]
    # r=16: 72.3 - acc(11) 72.15 = 0.15 < 0.2
    assert pr.converged_at(curve) == 16


def test_summary_table_and_verdict(tmp_path: Path) -> None:
    setting = {
        "arch": "cnn",
        "clients": 10,
        "alpha": 0.5,
        "rounds": 5,
        "local_epochs": 1,
        "train_limit": 6000,
        "test_images": 10000,
    }
    rows = (
        _rows("fedavg", FEDAVG, 1.0, 1e9)
        + _rows("public", PUBLIC, None, 0)
        + _rows("ridge", [80.0, 81.2, 79.1, 80.4, 79.6], 0.002, 5e5)
    )
    for r in rows:
        r.update(setting=setting, kind="x", converged_at=None)
        (tmp_path / f"{r['route']}-s{r['seed']}.json").write_text(json.dumps(r))
    (tmp_path / "head-s0.partial.json").write_text("{}")
    text = pr.summary([tmp_path])
    assert "| ridge | x | 0,1,2,3,4 | 80.06 ± 0.80 |" in text
    assert "QUALIFIES" in text and "Rule verdict: **ridge**" in text
    assert "Unfinished (partial files): head-s0.partial.json" in text


def test_budget_pace_stops_only_jobs_that_cannot_finish(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(pr.time, "monotonic", lambda: now[0])
    b = pr.Budget(100.0, start=1000.0)
    now[0] = 1030.0  # 30 s in, 70 s left; a job started at 1000 with 3 of 10 units done: 10 s a unit
    b.check_pace(1000.0, 3, 10, yield_late=False)  # without --yield-late: never
    # started 1 s earlier: 31 / 3 s a unit, 7 units -> ~72 s needed, 70 left
    with pytest.raises(pr.BudgetStop, match="3 of 10 done; the rest needs ~72 s, 70 s left") as e:
        b.check_pace(999.0, 3, 10, yield_late=True)
    assert "yield-late" in str(e.value)
    b.check_pace(1000.0, 3, 10, yield_late=True)  # exactly enough: goes on
    b.check_pace(1029.0, 1, 10, yield_late=True)  # one unit is no pace yet
    b.check()
    now[0] = 1100.0
    with pytest.raises(pr.BudgetStop, match="ran out"):
        b.check()


# -- issue 56: the plateau rule, refresh's sparse mean and bytes, the new routes end to end ----------------
def test_plateau_rule_on_a_hand_made_curve() -> None:
    # rounds 1-20 rise by 1 point a round: mean(11..20) - mean(1..10) = 10 -> no plateau at 20
    curve = [[r, 50.0 + r] for r in range(1, 21)]
    assert pr.plateau_at(curve) is None
    # then flat at 70.0: at r, last 10 = rounds r-9..r, the 10 before = r-19..r-10
    curve += [[r, 70.0] for r in range(21, 41)]
    # r = 38: last = 70 x 10 (29..38); before = 19..28: 69, 70, 70 x 8 = mean 69.9 -> gain 0.1 < 0.2 fires;
    # r = 37: before = 18..27: 68, 69, 70 x 8 -> 69.7, gain 0.3: not yet
    assert pr.plateau_at(curve) == 38
    # a missing round is never judged (nor any window that spans it)
    assert pr.plateau_at([c for c in curve if c[0] != 30]) is None
    # a window of 2, gain 0.5 (the rule's parameters are arguments): r = 5: mean(21, 21) - mean(20, 21) = 0.5,
    # not under 0.5; r = 6: 21 - 21 = 0 fires
    assert pr.plateau_at([[1, 10], [2, 20], [3, 21], [4, 21], [5, 21], [6, 21]], window=2, gain=0.5) == 6


def test_refresh_sparse_mean_by_hand() -> None:
    import torch

    g = torch.tensor([1.0, 1.0, 1.0, 1.0])
    # device 0 (weight 0.75): update (+3, -1, 0.5, 0); K = 1 -> sends +3 at 0, keeps (0, -1, 0.5, 0)
    # device 1 (weight 0.25): update (0, 0, -2, 1) + residual (0, 0, 0, 1.5) = (0, 0, -2, 2.5) -> sends 2.5 at 3
    locals_ = [g + torch.tensor([3.0, -1.0, 0.5, 0.0]), g + torch.tensor([0.0, 0.0, -2.0, 1.0])]
    residuals: list[Any] = [None, torch.tensor([0.0, 0.0, 0.0, 1.5])]
    new, res = pr.topk_ef_step(g, locals_, residuals, [0.75, 0.25], k=1)
    assert torch.allclose(new, torch.tensor([1.0 + 0.75 * 3.0, 1.0, 1.0, 1.0 + 0.25 * 2.5]))
    assert torch.allclose(res[0], torch.tensor([0.0, -1.0, 0.5, 0.0]))
    assert torch.allclose(res[1], torch.tensor([0.0, 0.0, -2.0, 0.0]))
    # next round, no training: device 0 sends its residual's largest (-1 at 1)
    new2, _ = pr.topk_ef_step(new, [new, new], res, [0.75, 0.25], k=1)
    assert torch.allclose(new2, new + torch.tensor([0.0, -0.75, -0.5, 0.0]))


def test_refresh_uplink_counts_statistics_sparse_updates_and_cps_prototypes() -> None:
    d, n, held = 1_000_000, 300, 7
    k = pr.topk_count(d, 0.001)
    assert k == 1000
    ridge = pr.params_upload_bytes(pr.ridge_values(pr.PROTO_DIM, 10), n, 1)
    sparse = pr.sparse_upload_bytes(d, k, n, 2)
    stats_rounds = [1, 11, 21]  # round 1 and every T = 10
    got = pr.refresh_client_uplink("refresh", n, held, 25, d, pr.PROTO_DIM, 10, "client-000")
    want = sum(pr.params_upload_bytes(pr.ridge_values(pr.PROTO_DIM, 10), n, r) for r in stats_rounds) + sum(
        pr.sparse_upload_bytes(d, k, n, r) for r in range(2, 26)
    )
    assert got == want and ridge * 3 + sparse * 24 - 100 < got < ridge * 3 + sparse * 24 + 100
    t0 = pr.refresh_client_uplink("refresh-t0", n, held, 25, d, pr.PROTO_DIM, 10, "client-000")
    assert t0 == want - sum(pr.params_upload_bytes(pr.ridge_values(pr.PROTO_DIM, 10), n, r) for r in (11, 21))
    proto = pr.refresh_client_uplink("refresh-proto", n, held, 25, d, pr.PROTO_DIM, 10, "client-000")
    assert proto == want + sum(pr.proto_upload_bytes(held, pr.CPS_S, n, r) for r in range(1, 26))
    # round 1 alone is the ridge route's upload
    assert pr.refresh_client_uplink("refresh", n, held, 1, d, pr.PROTO_DIM, 10, "client-000") == ridge


def test_new_routes_run_end_to_end_at_tiny_sizes(tmp_path: Path) -> None:
    out = tmp_path / "r"
    rc = pr.main(
        ["--out", str(out), "--routes", "fedavg-warm,refresh,refresh-proto,refresh-frozen-head", "--clients", "2",
         "--rounds", "2", "--train-limit", "400", "--test-limit", "60", "--public-epochs", "1", "--plateau-cap", "2",
         "--curve-test", "30", "--threads", "1", "--progress", "0"]
    )  # fmt: skip
    assert rc == 0
    warm = json.loads((out / "fedavg-warm-s0.json").read_text())
    assert warm["capped"] and warm["plateau_at"] is None and warm["rounds_done"] == 2
    assert [r for r, _ in warm["curve"]] == [1, 2] and warm["curve_test_images"] == 30
    assert warm["uplink_curve"][-1][1] == warm["uplink_total"] == warm["fedavg_uplink_total"]
    ref = json.loads((out / "refresh-s0.json").read_text())
    assert ref["rounds_done"] == 2 and ref["topk"] >= 1 and ref["resolve_every"] == 10
    assert 0 <= ref["round1_acc"] <= 100 and len(ref["downlink_sparse_values"]) == 2
    assert [r for r, _ in ref["uplink_curve"]] == [1, 2] and ref["uplink_curve"][-1][1] == ref["uplink_total"]
    assert ref["uplink_total"] < warm["uplink_total"]
    proto = json.loads((out / "refresh-proto-s0.json").read_text())
    assert proto["uplink_total"] > ref["uplink_total"] and proto["objective"] == "proto"
    frozen = json.loads((out / "refresh-frozen-head-s0.json").read_text())
    assert frozen["uplink_total"] == ref["uplink_total"] and frozen["objective"] == "ce-frozen-head"
