"""End-to-end in-process federations: what a user reads in the report is what happened.

Every preset runs once on one synthetic federation (defaults: m = 512, cnn); every message that
crosses the in-process broker is recorded, so the report's byte counts are checked against the
encoded messages themselves, not against the aggregator's own bookkeeping alone.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from broker_server.core.shell import Aggregator
from broker_server.simulation import SimulationSpec, prepare, run_simulation
from broker_server.simulation.spec import FED as SIM_FED
from protofl import topics
from protofl.presets import PRESETS
from protofl.transport.inprocess import InProcessTransport
from protofl.wire import Envelope, unpack_envelope
from tests.pipelines import NO_FLOOR

FED: dict[str, Any] = dict(
    dataset="synthetic:n=600,n_test=100", clients=4, alpha=0.5, rounds=2, seed=3, overrides=NO_FLOOR
)
PROTOTYPE_PRESETS = [p for p in PRESETS if p != "fedavg"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@dataclass
class Run:
    report: dict[str, Any]
    agg: Aggregator
    wire: list[tuple[str, Envelope, int]]  # (topic, envelope, encoded size) of every message published


@pytest.fixture(scope="module")
def runs(one_torch_thread: None) -> dict[str, Run]:
    publish = InProcessTransport.publish
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        for preset in PRESETS:
            wire: list[tuple[str, Envelope, int]] = []

            def spy(
                self: InProcessTransport,
                topic: str,
                payload: bytes,
                *,
                retain: bool = False,
                qos: int = 1,
                wire: list = wire,
            ) -> None:
                if payload:  # an empty retained payload clears a topic: not a message
                    wire.append((topic, unpack_envelope(payload), len(payload)))
                publish(self, topic, payload, retain=retain, qos=qos)

            mp.setattr(InProcessTransport, "publish", spy)
            finished: list[Aggregator] = []
            # every round scores the test set: the accuracy columns of every row are what these tests check
            report = run_simulation(SimulationSpec(preset=preset, **FED, test_every=1), on_finish=finished.append)
            out[preset] = Run(report, finished[0], wire)
    return out


def counted_from_the_wire(run: Run) -> tuple[Counter[int], Counter[int], Counter[int]]:
    """(uplink, downlink, metrics) bytes per round, recounted from the messages that were sent.

    Uplink: every client upload (joins count in round 1, when they were needed); metrics travel apart.
    Downlink: every client receives each round announcement of the round, and config and public set once
    (round 1); the final "done" announcement closes the federation and belongs to no round."""
    fed, n = SIM_FED, FED["clients"]
    up: Counter[int] = Counter()
    down: Counter[int] = Counter()
    metrics: Counter[int] = Counter()
    for topic, env, size in run.wire:
        if topic.startswith(topics.up(fed, "")):
            (metrics if env.kind == "metrics" else up)[max(env.round, 1)] += size
        elif topic == topics.round_(fed) and env.phase != "done":
            down[env.round] += size * n
        elif topic in (topics.config(fed), topics.public(fed)):
            down[1] += size * n
    return up, down, metrics


@pytest.mark.parametrize("preset", list(PRESETS))
def test_report_bytes_are_the_encoded_messages(runs: dict[str, Run], preset: str) -> None:
    run = runs[preset]
    r = run.report
    json.dumps(r)  # the report is plain JSON
    up, down, metrics = counted_from_the_wire(run)
    rows = r["rounds"]
    assert [row["round"] for row in rows] == [1, 2] == [rec.round for rec in run.agg.records]
    for row, rec in zip(rows, run.agg.records, strict=True):
        assert (row["uplink_bytes"], row["downlink_bytes"]) == (rec.uplink_bytes, rec.downlink_bytes)
        assert row["uplink_bytes"] == up[row["round"]] > 0
        assert row["downlink_bytes"] == down[row["round"]] > 0
        assert row["metrics_bytes"] == metrics[row["round"]] > 0
    assert r["totals"]["uplink_bytes"] == sum(up.values())
    assert r["totals"]["downlink_bytes"] == sum(down.values())


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_round_closes_by_quorum_with_every_client(runs: dict[str, Run], preset: str) -> None:
    r = runs[preset].report
    assert r["preset"] == r["config"]["preset"] == preset
    assert r["simulation"]["device"] == "cpu" and r["simulation"]["transport"] == "inprocess"
    for row in r["rounds"]:
        assert (row["closed_by"], row["clients"]) == ("quorum", FED["clients"])
    assert r["dropped"] == {}


def test_accuracy_columns(runs: dict[str, Run]) -> None:
    for preset, run in runs.items():
        for row in run.report["rounds"]:
            for key in ("local_acc", "global_acc"):
                assert 0.0 <= row[key] <= 1.0, (preset, key, row)
            # The nearest-prototype pair sits beside the head's in every row; FedAvg has no prototypes.
            assert {"local_proto_acc", "global_proto_acc"} <= set(row)
            if preset == "fedavg":
                assert row["local_proto_acc"] is None and row["global_proto_acc"] is None
                assert row["ensemble_acc"] is None  # FedAvg has one global model, no ensemble
            else:
                assert 0.0 <= row["ensemble_acc"] <= 1.0


@pytest.mark.parametrize("preset", PROTOTYPE_PRESETS)
def test_prototype_presets_report_nearest_prototype_accuracy(runs: dict[str, Run], preset: str) -> None:
    rows = runs[preset].report["rounds"]
    # FedProto-style presets hold no global prototypes in round 1 (nothing aggregated yet): None there.
    # ERPA anchors and FedPAGR's round-0 prototypes (also the spherical protofl preset's) exist from round 1 on.
    first_has = preset in ("refprotofl", "fedpagr", "protofl")
    for row in rows[0 if first_has else 1 :]:
        assert 0.0 <= row["local_proto_acc"] <= 1.0 and 0.0 <= row["global_proto_acc"] <= 1.0, row
    if not first_has:
        assert rows[0]["local_proto_acc"] is None and rows[0]["global_proto_acc"] is None


def test_uplink_byte_ratios_measured_from_encoded_messages(runs: dict[str, Run]) -> None:
    from protofl.algorithms.ridge import ridge_length, ridge_statistics
    from protofl.wire import ParamsUpload, message_size

    up = {p: runs[p].report["totals"]["uplink_bytes"] for p in PRESETS}
    assert up["tinyproto"] <= up["fedproto"] / 8  # s = m/10, fp32
    for p in ("fedproto", "tinyproto", "fedpagr"):
        assert up[p] <= up["fedavg"] / 100, (p, up[p], up["fedavg"])
    assert up["refprotofl"] <= up["fedavg"] / 20, up
    # The default preset's global predictor: each device's ridge statistics once (m = 512, C: 548 KB), round 1.
    cfg = runs["protofl"].report["config"]
    m, c, n = cfg["proto_dim"], cfg["num_classes"], FED["clients"]
    stats = message_size(
        ParamsUpload(update=ridge_statistics(np.zeros((1, m)), np.zeros(1, int), c), n_samples=1, base_round=1),
        fed=SIM_FED,
        sender="client-000",
        round=1,
        phase="train",
    )
    assert ridge_length(m, c) * 4 < stats < ridge_length(m, c) * 4 + 200
    rounds = runs["protofl"].report["rounds"]
    assert rounds[0]["uplink_bytes"] - rounds[1]["uplink_bytes"] > n * (stats - 200), rounds
    # Without them (and their empty follow-ups, ~150 B a device and round), the default preset (spherical CPS)
    # sends TinyProto's bytes: goal 4's budget is 2x; with them, one cnn FedAvg upload is still 12x a device's.
    assert up["protofl"] - n * stats - n * FED["rounds"] * 160 <= 2 * up["tinyproto"], up
    assert n * stats <= up["fedavg"] / FED["rounds"] / 10, up


def test_partition_is_identical_across_presets() -> None:
    base = prepare(SimulationSpec(preset="fedavg", **FED)).split
    for preset in PROTOTYPE_PRESETS:
        split = prepare(SimulationSpec(preset=preset, **FED)).split
        assert np.array_equal(split.public, base.public), preset
        for a, b in zip(base.clients, split.clients, strict=True):
            assert np.array_equal(a.train, b.train) and np.array_equal(a.test, b.test), preset


def test_fedproto_learns_an_easy_task() -> None:
    # Four well-separated synthetic classes, near-IID clients (alpha = 100), so chance is 0.25 on every
    # client's held-out split. Measured with seeds 0-4: final local accuracy 0.68-0.87.
    easy = SimulationSpec(
        preset="fedproto",
        dataset="synthetic:n=900,n_test=200,classes=4,noise=0.05,size=16",
        clients=3,
        alpha=100.0,
        rounds=3,
        seed=0,
        archs=("mlp",),
        overrides=dict(local_epochs=5, lr=0.05),
    )
    rows = run_simulation(easy)["rounds"]
    assert rows[-1]["local_acc"] > 0.5, rows
    assert rows[-1]["global_acc"] > 0.5, rows


def test_same_seed_same_result() -> None:
    spec = SimulationSpec(
        preset="tinyproto", dataset="synthetic:n=600,n_test=100", clients=3, rounds=1, seed=5, overrides=NO_FLOOR
    )
    a, b = run_simulation(spec), run_simulation(spec)
    assert a["rounds"] == b["rounds"]


def test_a_stall_names_every_sides_drops(monkeypatch: pytest.MonkeyPatch) -> None:
    # A device that rejects every round announcement: nobody uploads, the round never closes.
    from edge_agent.core.agent import EdgeAgent
    from edge_agent.core.outcome import Outcome

    receive = EdgeAgent.receive

    def reject_rounds(self: EdgeAgent, topic: str, payload: bytes, **kwargs) -> Outcome:
        if topic == topics.round_(SIM_FED):
            self._drop("test_reject", "round announcement rejected by the test")
            return Outcome()
        return receive(self, topic, payload, **kwargs)

    monkeypatch.setattr(EdgeAgent, "receive", reject_rounds)
    spec = SimulationSpec(preset="fedproto", dataset="synthetic:n=400,n_test=50", clients=2, rounds=1, seed=1)
    with pytest.raises(RuntimeError, match="simulation stalled in round 1") as err:
        run_simulation(spec)
    msg = str(err.value)
    assert "dropped by the aggregator: none" in msg
    assert "'client-000': {'test_reject': 1}" in msg and "'client-001': {'test_reject': 1}" in msg


@pytest.mark.parametrize("preset", ["fedavg", "tinyproto"])
def test_test_set_is_scored_only_on_its_cadence(preset: str) -> None:
    # Local accuracy every round, the (dear) official test set every 2nd round and in the last.
    spec = SimulationSpec(preset=preset, **{**FED, "rounds": 3}, eval_every=1, test_every=2)
    rows = run_simulation(spec)["rounds"]
    assert [r["local_acc"] is not None for r in rows] == [True, True, True]
    assert [r["global_acc"] is not None for r in rows] == [False, True, True]
    if preset == "fedavg":  # the aggregated model's accuracy; no ensemble of identical models
        assert all(r["ensemble_acc"] is None for r in rows)
    else:
        assert [r["ensemble_acc"] is not None for r in rows] == [False, True, True]
        # CPS rows report how much of z's energy is still off its class's mask
        assert all(0.0 <= r["off_mask_energy"] <= 1.0 for r in rows)


@pytest.mark.parametrize("cps_s, refine", [(51, False), (128, True)])
def test_spherical_cps_sends_fedpagr_prototypes_on_their_masks(runs: dict[str, Run], cps_s: int, refine: bool) -> None:
    # Candidates (b) and (c) of the combined pipeline: FedPAGR's objective on CPS-masked unit prototypes.
    run = run_simulation(
        SimulationSpec(
            preset="fedpagr", **{**FED, "overrides": {**NO_FLOOR, "cps": True, "cps_s": cps_s, "refine": refine}}
        )
    )
    dense = runs["fedpagr"].report
    assert not run["dropped"]
    assert all(r["closed_by"] == "quorum" and r["clients"] == FED["clients"] for r in run["rounds"])
    # every upload holds C x s values instead of C x m (plus the same envelope): about m/s fewer bytes
    ratio = dense["totals"]["uplink_bytes"] / run["totals"]["uplink_bytes"]
    assert 0.7 * 512 / cps_s < ratio < 512 / cps_s, ratio
    # the prototypes the devices align to live on their masks: features move onto them
    assert all(0.0 <= r["off_mask_energy"] <= 1.0 for r in run["rounds"])
    assert run["rounds"][-1]["global_proto_acc"] is not None


def test_spherical_cps_with_erpa_anchors_public_classes_on_the_public_set() -> None:
    # Candidate (d): (b) + ERPA anchors from the public set, normalised. The devices send unit public-set
    # prototypes with their training upload; the next round's prototype of a public class is their
    # normalised uniform mean, cut to the class's mask.
    from protofl.algorithms import support
    from protofl.algorithms.unit import normalize_rows
    from protofl.wire import ProtoUpload, decode_message

    uploads: list[ProtoUpload] = []
    publish = InProcessTransport.publish

    def spy(self: InProcessTransport, topic: str, payload: bytes, *, retain: bool = False, qos: int = 1) -> None:
        if payload and topic.startswith(topics.up(SIM_FED, "")):
            env, msg = decode_message(payload)
            if env.round == FED["rounds"] and isinstance(msg, ProtoUpload):
                uploads.append(msg)
        publish(self, topic, payload, retain=retain, qos=qos)

    finished: list[Aggregator] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(InProcessTransport, "publish", spy)
        run = run_simulation(
            SimulationSpec(
                preset="fedpagr", **{**FED, "overrides": {**NO_FLOOR, "cps": True, "refine": False, "erpa": True}}
            ),
            on_finish=finished.append,
        )
    assert not run["dropped"]
    assert all(r["closed_by"] == "quorum" and r["clients"] == FED["clients"] for r in run["rounds"])
    model = finished[0].model
    public = model.plan.public_classes
    masks, unit = model.rules.support_masks(), model.rules.unit_prototypes()
    assert public and len(uploads) == FED["clients"] and masks is not None and unit is not None
    for up in uploads:
        assert up.public is not None and set(up.public.table()[0]) == set(public)
        assert up.local is not None and not set(up.local.table()[0]) & set(public)  # uncovered classes only
    publics = [up.public for up in uploads if up.public is not None]
    for c in public:
        rows = [support.reconstruct_table({c: pub.table()[0][c]}, masks)[c] for pub in publics]
        expected = support.restrict_to_masks(
            normalize_rows(np.mean(normalize_rows(np.stack(rows)), axis=0))[None], masks[[c]]
        )[0]
        np.testing.assert_allclose(unit[c], expected, atol=1e-5)


def test_the_nearest_own_prototype_is_scored_in_every_round_and_the_machine_is_recorded(runs: dict[str, Run]) -> None:
    # TinyProto's eq. 12 (each client's own class means) needs nothing from the federation: every preset, FedAvg
    # included, has it from round 1, where FedProto has no global prototype yet (local_proto_acc None).
    for preset, run in runs.items():
        for row in run.report["rounds"]:
            assert 0.0 <= row["local_own_proto_acc"] <= 1.0, (preset, row)
        machine = run.report["machine"]
        assert machine["torch_threads"] >= 1 and machine["cpus"] >= 1 and machine["cpu_model"], machine
    first = runs["fedproto"].report["rounds"][0]
    assert first["local_proto_acc"] is None and first["local_own_proto_acc"] is not None
