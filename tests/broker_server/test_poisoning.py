"""Bounded uploads: a poisoning client against clipping (default) and --robust median (issue 14).

Honest clients send their class centre plus small noise; poisoners send finite prototypes of norm 1e6
with huge claimed counts. The federation runs through the real aggregator (in-process broker).
"""

from __future__ import annotations

import numpy as np
import pytest

from broker_server.core.shell import Aggregator
from protofl import topics
from protofl.algorithms.robust import ClipPolicy, CoordinateRobust, clip_around
from protofl.presets import make_config
from protofl.transport import InProcessBroker
from protofl.wire import Join, Message, ProtoSet, ProtoUpload, encode_message
from tests.pipelines import ADAPTER_PIPELINE

FED = "poison"
C, M, ROUNDS = 4, 8, 4
CENTRES = np.eye(C, M) * 5.0  # class c's honest prototypes sit near 5 e_c


def run(
    n_honest: int, n_poison: int, policy: ClipPolicy | None, seed: int = 0
) -> tuple[list[dict], list[dict], Aggregator]:
    """Globals after each round, the radius each round used, and the aggregator."""
    cfg = make_config(
        "fedproto", rounds=ROUNDS, num_classes=C, proto_dim=M, adapter_rank=1, min_clients=1, round_timeout=30.0
    )
    broker = InProcessBroker()
    ids = [f"h{i}" for i in range(n_honest)] + [f"p{i}" for i in range(n_poison)]
    agg = Aggregator(cfg, FED, broker.connect("server"), clock=lambda: 0.0, expected_clients=ids, policy=policy)
    agg.start()
    rng = np.random.default_rng(seed)

    def send(cid: str, msg: Message, round_: int = 0, phase: str = "") -> None:
        broker.connect(cid).publish(
            topics.up(FED, cid), encode_message(msg, fed=FED, sender=cid, round=round_, phase=phase)
        )

    for cid in ids:
        send(cid, Join(arch="cnn", n_samples=100))
    broker.pump()
    globals_, radii = [], []
    for r in range(1, ROUNDS + 1):
        assert agg.round == r and not agg.finished
        radii.append(agg.model.radius("protos"))
        for cid in ids:
            if cid.startswith("h"):
                values = CENTRES + rng.normal(0, 0.1, (C, M))
                counts = np.full(C, 20)
            else:
                values = np.full((C, M), 1e6 / np.sqrt(M))  # norm 1e6, finite
                counts = np.full(C, 10**9)  # and a huge claimed weight
            ps = ProtoSet(classes=np.arange(C), values=values.astype(np.float32), counts=counts)
            send(cid, ProtoUpload(local=ps, public=None, n_samples=100), r, "train")
        broker.pump()
        globals_.append({c: v.astype(np.float64) for c, v in agg.model.rules.state_values()["prototypes"].items()})
    return globals_, [{"radius": x} for x in radii], agg


def test_clip_around_by_hand() -> None:
    # u = (3, 4) around 0: distance 5; radius 2.5 halves it to (1.5, 2); inside the ball u is returned as is.
    v, d = clip_around(np.array([3.0, 4.0]), np.zeros(2), 2.5)
    assert d == 5.0 and np.allclose(v, [1.5, 2.0])
    v, d = clip_around(np.array([3.0, 4.0]), np.array([3.0, 3.0]), 2.5)
    assert d == 1.0 and np.array_equal(v, [3.0, 4.0])


def test_coordinate_median_and_trimmed_mean_by_hand() -> None:
    # Coordinate 0 from 5 senders: 1, 2, 3, 4, 100 -> median 3; trimmed (20 %: one each end) (2+3+4)/3 = 3.
    # Coordinate 1 sent by two (10 and 20): median 15; trimmed keeps both (floor(0.4) = 0): 15.
    # Coordinate 2 sent by nobody keeps the default 7.
    for mode in ("median", "trimmed"):
        acc = CoordinateRobust(3, mode, trim=0.2)
        for x in (1, 2, 3, 4, 100):
            acc.add(np.array([float(x)]), np.array([0]))
        acc.add(np.array([10.0]), np.array([1]))
        acc.add(np.array([20.0]), np.array([1]))
        assert np.allclose(acc.result(np.array([0.0, 0.0, 7.0])), [3.0, 15.0, 7.0]), mode


def test_a_poisoner_moves_no_global_prototype_more_than_the_clipping_bound() -> None:
    honest, _, _ = run(2, 0, None)
    poisoned, radii, agg = run(2, 1, None)
    assert agg.finished and [r.closed_by for r in agg.records] == ["quorum"] * ROUNDS  # the federation finishes
    previous = {c: np.zeros(M) for c in range(C)}
    for r, (g, rad) in enumerate(zip(poisoned, radii, strict=True), 1):
        for c in range(C):
            moved = np.linalg.norm(g[c] - previous[c])
            assert moved <= rad["radius"] * (1 + 1e-9), (r, c, moved, rad)
        previous = g
    # From round 2 the bound is the federation's own statistic: 10 x the median accepted norm, where the
    # honest norms (about 5) are the majority, so 50 (+ noise), not 1e6.
    assert radii[0]["radius"] == ClipPolicy().first_radius and all(40 < x["radius"] < 60 for x in radii[1:])
    assert agg.model.clipped["protos"] >= ROUNDS * C  # every poisoned prototype was clipped
    # Without clipping the 1e9 claimed samples would put every global at ~1e6 / sqrt(8) a coordinate.
    assert all(np.abs(g).max() < 2e4 for g in poisoned[-1].values())


def test_robust_median_two_poisoners_of_ten_move_the_result_less_than_the_bound() -> None:
    policy = ClipPolicy(robust="median")
    honest, _, _ = run(8, 0, policy)
    poisoned, radii, agg = run(8, 2, policy)
    assert agg.finished
    for r, (g_h, g_p, rad) in enumerate(zip(honest, poisoned, radii, strict=True), 1):
        for c in range(C):
            moved = np.linalg.norm(g_p[c] - g_h[c])
            # The median of 10 with 2 outliers stays among the honest values: well inside the bound.
            assert moved < rad["radius"] and moved < 1.0, (r, c, moved, rad)


def test_robust_policy_is_checked() -> None:
    with pytest.raises(ValueError, match="median, trimmed"):
        ClipPolicy(robust="mode")
    with pytest.raises(ValueError, match="clip factor"):
        ClipPolicy(factor=float("inf"))


@pytest.mark.parametrize("robust", ["mean", "median"])
def test_adapter_uploads_are_clipped_around_the_global_adapter(robust: str) -> None:
    # APUD: 4 honest clients move coordinates 0..9 by +0.01, a poisoner sends 1e6 on the same ones with a
    # huge weight. Round 1's radius is the first radius; the mean moves by at most it, the median by 0.01.
    from broker_server.core.stages import PhaseRun, build_model
    from protofl.adapter import adapter_layout, initial_adapter
    from protofl.algorithms.fedavg import FederatedVector
    from protofl.plan import Phase, RoundPlan, Upload
    from protofl.sparse import SparseVector
    from protofl.wire import ParamsUpload

    cfg = make_config("protofl", num_classes=C, proto_dim=M, adapter_rank=1, **ADAPTER_PIPELINE)
    policy = ClipPolicy(first_radius=1.0, robust=robust)
    model = build_model(cfg, RoundPlan.from_config(cfg), policy)
    vec = model.rules.state(FederatedVector)
    vec.adapter = initial_adapter(adapter_layout(M, 1, C), seed=0)
    before = vec.adapter.astype(np.float64).copy()
    phase = PhaseRun(model, Phase.TRAIN)
    idx = np.arange(10)
    for k in range(5):
        vals = before[idx] + (1e6 if k == 4 else 0.01)
        phase.add(
            Upload.ADAPTER,
            ParamsUpload(
                update=SparseVector(before.shape[0], idx, vals.astype(np.float32)),
                n_samples=10**9 if k == 4 else 10,
                base_round=1,
                dt="f4",
            ),
        )
    phase.finish()
    moved = np.linalg.norm(vec.adapter.astype(np.float64) - before)
    if robust == "mean":
        assert moved <= 1.0 + 1e-5 and model.clipped["adapter"] == 1
    else:
        assert moved < 0.05  # the median is an honest value: 0.01 on each of 10 coordinates, ~0.032
