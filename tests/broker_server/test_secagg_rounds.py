"""Secure aggregation in the rounds (broker_server/core/secagg_run.py, edge_agent/core/secagg_device.py), without torch
or a
broker process: the aggregator as `start` runs it (its shell, its journal) over the in-process broker, and devices
that are the agent's secure-aggregation half answering the server's steps on their `down/` topics.

What is checked: the unmasked sum folds to the global prototypes a plain run folds from the same uploads (the
fixed-point ring's tolerance), with 0, 1 and 2 of 6 devices dropped mid-phase (2 is the most a threshold of 3 of 5
neighbours leaves: every secret still has 3 answering holders); what the aggregator holds and journals before the
unmask step closes is masked; a restart after any message of the steps (the state dir as a kill -9 leaves it)
ends exactly as the uninterrupted run; what cannot combine is refused at start with the reason."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from broker_server.core import secagg_run
from broker_server.core.durable import DurableState, journal_records
from broker_server.core.shell import Aggregator
from edge_agent.core.secagg_device import DeviceSecAgg, params_vector, table_vector
from protofl import secagg, topics
from protofl.adapter import adapter_layout, initial_adapter
from protofl.algorithms.robust import ClipPolicy
from protofl.config import FederationConfig
from protofl.errors import ConfigError
from protofl.plan import Phase, RoundPlan
from protofl.presets import make_config
from protofl.transport import InProcessBroker, Transport
from protofl.wire import (
    Join,
    ParamsUpload,
    ProtoSet,
    ProtoUpload,
    RoundStart,
    SaKeys,
    SaMasked,
    SaRoster,
    SaRouted,
    SaShares,
    decode_message,
    encode_message,
)
from tests.broker_server.durable_helpers import start_durable
from tests.broker_server.test_restart_presence import Clock

FED = "sa"
CLIENTS = [f"d{i}" for i in range(6)]
OFF = ClipPolicy(enabled=False)


# One round of fedproto on 4 classes of 5-d prototypes; a step's deadline 60 s after it opened.
SMALL: dict[str, Any] = {"rounds": 1, "num_classes": 4, "proto_dim": 5, "adapter_rank": 2, "round_timeout": 60.0}


def _cfg(secure: bool = True, **kw: Any) -> FederationConfig:
    return make_config("fedproto", **{**SMALL, "secagg": secure, **kw})


def _steps(agg: Aggregator) -> secagg_run.SecAggRun | None:
    """The open phase's secure-aggregation steps (its machine's closing's)."""
    closing = agg.machine.closing
    assert isinstance(closing, secagg_run.SecAggClosing)
    return closing.run


def _table(i: int, round_: int) -> ProtoSet:
    """Device i's prototypes: classes (i, i+1, i+2) mod 4, rows near 1, counts 3..: every class from 4+ devices."""
    rng = np.random.default_rng(10 * round_ + i)
    classes = np.sort(np.array([i % 4, (i + 1) % 4, (i + 2) % 4]))
    return ProtoSet(classes, rng.normal(1.0, 0.5, (3, 5)).astype(np.float32), np.array([3 + i, 4, 5 + i % 2]), dt="f4")


class Devices:
    """The devices of the federation: each answers the server's steps (`drop`: client -> the step it stops before:
    "keys", "shares", "masked" or "unmask"). Every message a device sends is recorded, in order."""

    def __init__(
        self,
        transport: Transport,
        cfg: FederationConfig,
        drop: dict[str, str],
        vectors: dict[str, ParamsUpload] | None = None,  # FedAvg: each device's upload, masked instead of a table
    ) -> None:
        self.t = transport
        self.vectors = vectors
        self.plan = RoundPlan.from_config(cfg)
        self.drop = drop
        self.runs: dict[str, DeviceSecAgg] = {}
        self.sent: list[tuple[str, bytes]] = []
        self.t.subscribe(topics.round_(FED), self._round)
        for c in CLIENTS:
            self.t.subscribe(topics.down(FED, c), self._down)

    def send(self, client: str, msg: object, round_: int = 0, phase: str = "") -> None:
        payload = encode_message(msg, fed=FED, sender=client, round=round_, phase=phase)  # type: ignore[arg-type]
        self.sent.append((topics.up(FED, client), payload))
        self.t.publish(topics.up(FED, client), payload)

    def join(self) -> None:
        for c in CLIENTS:
            self.send(c, Join(arch="", n_samples=20, profile="", agent_version="t"))

    def _round(self, topic: str, payload: bytes) -> None:
        env, msg = decode_message(payload)
        assert isinstance(msg, RoundStart)
        if msg.final or env.phase != "train":
            return
        for i, c in enumerate(CLIENTS):
            if c in self.runs and self.runs[c].round == env.round:
                continue  # announced again: its keys went already (the server drops a second copy)
            if self.vectors is not None:
                self.runs[c] = DeviceSecAgg(c, FED, env.round, env.phase, None, params_vector(self.vectors[c]))
            else:
                self.runs[c] = DeviceSecAgg(c, FED, env.round, env.phase, _table(i, env.round))
            if self.drop.get(c) != "keys":
                self.send(c, self.runs[c].keys(), env.round, env.phase)

    def _down(self, topic: str, payload: bytes) -> None:
        env, msg = decode_message(payload)
        c = topic.rsplit("/", 1)[1]
        nxt = {"sa_roster2": "shares", "sa_routed2": "masked", "sa_survivors2": "unmask"}[msg.KIND]
        if self.drop.get(c) in {"keys", "shares", "masked", "unmask"} and _at_or_after(nxt, self.drop[c]):
            return
        out = self.runs[c].answer(msg, self.plan.num_classes, self.plan.proto_width)
        assert out is not None
        self.send(c, out, env.round, env.phase)


def _at_or_after(step: str, drop: str) -> bool:
    order = ["keys", "shares", "masked", "unmask"]
    return order.index(step) >= order.index(drop)


def _aggregator(
    cfg: FederationConfig, broker: InProcessBroker, clock: Clock, state: Path | None = None
) -> tuple[Aggregator, DurableState | None]:
    agg = Aggregator(cfg, FED, broker.connect("server"), expected_clients=CLIENTS, policy=OFF, clock=clock)
    return agg, start_durable(agg, state, FED)


def _run(
    drop: dict[str, str],
    state: Path | None = None,
    cfg: FederationConfig | None = None,
    vectors: dict[str, ParamsUpload] | None = None,
) -> tuple[Aggregator, Devices, Clock]:
    """A secure federation of 6 devices, one round; a step that waits for a dropped device closes at its deadline."""
    cfg, broker, clock = cfg or _cfg(), InProcessBroker(), Clock()
    agg, _ = _aggregator(cfg, broker, clock, state)
    devices = Devices(broker.connect("devices"), cfg, drop, vectors)
    devices.join()
    for _ in range(8):
        broker.pump()
        if agg.finished:
            break
        clock.now += 61.0  # past the open step's deadline: it closes with those that answered
        agg.tick()
    assert agg.finished, (sa := _steps(agg)) and sa.step
    return agg, devices, clock


def _plain_run(cfg: FederationConfig, uploads: dict[str, Any]) -> Aggregator:
    """A plain run (no secure aggregation) of one round folding `uploads` (sender -> its train-phase upload)."""
    broker = InProcessBroker()
    agg = Aggregator(cfg, FED, broker.connect("server"), expected_clients=list(uploads), policy=OFF)
    agg.start()
    t = broker.connect("devices")
    for c in uploads:
        t.publish(topics.up(FED, c), encode_message(Join("", 20, "", "t"), fed=FED, sender=c))
    broker.pump()
    for c, up in uploads.items():
        t.publish(topics.up(FED, c), encode_message(up, fed=FED, sender=c, round=1, phase="train"))
    broker.pump()
    assert agg.finished and agg.dropped == {}
    return agg


def _plain(senders: list[str]) -> dict[int, np.ndarray]:
    """The global prototypes of a plain run folding the same devices' tables."""
    agg = _plain_run(_cfg(secure=False), {c: ProtoUpload(_table(CLIENTS.index(c), 1), None, 20) for c in senders})
    return dict(agg.model.rules.state_values()["prototypes"])


def _protos(agg: Aggregator) -> dict[int, np.ndarray]:
    return dict(agg.model.rules.state_values()["prototypes"])


@pytest.mark.parametrize(
    "drop",
    [
        {},
        {"d1": "masked"},  # shared its keys, sent no masked input: its pairwise masks are rebuilt from its key's shares
        {"d1": "masked", "d4": "unmask"},  # and one that sent its masked input but never answers the unmasking
        {"d0": "keys", "d2": "shares"},  # never advertised; advertised, then sent no shares
    ],
    ids=["none", "one", "two_mid_phase", "two_early"],
)
def test_the_unmasked_sum_folds_as_the_plain_sum_with_devices_dropped(drop: dict[str, str]) -> None:
    agg, _, _ = _run(drop)
    senders = [c for c in CLIENTS if c not in drop or drop[c] == "unmask"]  # who sent a masked input
    assert agg.records[0].clients == senders
    got, want = _protos(agg), _plain(senders)
    assert sorted(got) == sorted(want) == [0, 1, 2, 3]
    # The ring's tolerance: each value off by at most 2^-(f+1) (f = 15 for 6 values within +-1e4), a weighted mean
    # of them by less; float32 rows against float64 sums add ~1e-7.
    for c in want:
        np.testing.assert_allclose(got[c], want[c], atol=2e-4)
    assert set(agg.dropped) <= {"stale"}  # a late answer of a dropped device, if any


def test_the_server_holds_and_journals_only_masked_values_until_the_unmask_step_closes(tmp_path: Path) -> None:
    cfg, broker, clock = _cfg(), InProcessBroker(), Clock()
    agg, durable = _aggregator(cfg, broker, clock, tmp_path)
    devices = Devices(
        broker.connect("devices"), cfg, {c: "unmask" for c in CLIENTS}
    )  # nobody answers the unmasking: it stays open
    devices.join()
    broker.pump()
    sa = _steps(agg)
    assert sa is not None and sa.step == "unmask" and len(sa.server.masked) == 6
    plan = RoundPlan.from_config(cfg)
    assert sa.fp is not None
    plain = {
        c: sa.fp.encode(table_vector(_table(i, 1), plan.num_classes, plan.proto_width, weighted=True))
        for i, c in enumerate(CLIENTS)
    }
    journaled = [decode_message(r.payload)[1] for r in journal_records(tmp_path)]
    masked_journaled = [m.y for m in journaled if isinstance(m, SaMasked)]
    assert len(masked_journaled) == 6 and not any(isinstance(m, ProtoUpload) for m in journaled)
    for y in [*sa.server.masked.values(), *masked_journaled]:
        for x in plain.values():
            # A masked vector is uniform on the ring: it agrees with a device's plain vector in ~ 1 of 2^32 values.
            assert np.count_nonzero(y == x) <= 1
    total = np.zeros(plan.num_classes * (plan.proto_width + 1), dtype=np.uint32)
    for x in plain.values():
        total += x
    assert not np.array_equal(sum(sa.server.masked.values(), np.uint32(0)), total)  # the self masks are still on
    assert _protos(agg) == {}  # nothing folded yet
    assert durable is not None
    durable.close()


def test_a_restart_after_any_message_of_the_steps_ends_as_the_uninterrupted_run(tmp_path: Path) -> None:
    ref, devices, _ = _run({"d3": "unmask"})  # the unmask step closes at its deadline: a journaled timer
    msgs = devices.sent
    want = _protos(ref)

    # The live run, durable, its state dir copied after every message a device sent (a kill -9 right after it).
    cfg, broker, clock = _cfg(), InProcessBroker(), Clock()
    live, durable = _aggregator(cfg, broker, clock, tmp_path / "live")
    cuts: list[Path] = []
    t = broker.connect("devices")
    for i, (topic, payload) in enumerate(msgs):
        t.publish(topic, payload)
        broker.pump()
        cuts.append(tmp_path / f"cut{i}")
        shutil.copytree(tmp_path / "live", cuts[-1])
    clock.now += 61.0
    live.tick()  # d3 never answers: the unmask step closes at its deadline
    assert live.finished and _protos(live).keys() == want.keys()
    assert durable is not None
    durable.close()
    steps = [i for i, (_, p) in enumerate(msgs) if decode_message(p)[0].kind.startswith("sa_")]
    for i in sorted(set(steps[:: max(1, len(steps) // 8)] + steps[-3:])):  # over every step, the unmasking's last
        clock2 = Clock()
        agg, d = _aggregator(cfg, InProcessBroker(), clock2, cuts[i])
        # The last message was perhaps not acknowledged: the broker delivers it (and the devices resend) again.
        for topic, payload in msgs[i:]:
            agg.on_message(topic, payload)
        if not agg.finished:
            clock2.now += 61.0
            agg.tick()
        assert agg.finished, f"restart after message {i}: {(sa := _steps(agg)) and sa.step}"
        got = _protos(agg)
        assert got.keys() == want.keys()
        for c in want:  # the same sum, unmasked from the same journaled inputs: bit for bit
            np.testing.assert_array_equal(got[c], want[c], err_msg=f"restart after message {i}")
        assert set(agg.dropped) <= {"duplicate"}, agg.dropped
        assert d is not None
        d.close()


def test_what_cannot_combine_with_secure_aggregation_is_refused_at_start() -> None:
    broker = InProcessBroker()
    with pytest.raises(ConfigError, match="server-side clipping .* pass --clip off"):
        Aggregator(_cfg(), FED, broker.connect("a"), policy=ClipPolicy())
    with pytest.raises(ConfigError, match="--robust median needs every upload's rows"):
        Aggregator(_cfg(), FED, broker.connect("b"), policy=ClipPolicy(robust="median"))
    with pytest.raises(ConfigError, match="adapters beside prototypes and sparse top-K adapter updates are not masked"):
        make_config("protofl", secagg=True)
    with pytest.raises(ConfigError, match="buffer_k"):
        _cfg(buffer_k=2)


def test_step_messages_that_do_not_fit_are_dropped_with_their_reason_and_change_nothing() -> None:
    cfg, broker, clock = _cfg(), InProcessBroker(), Clock()
    agg, _ = _aggregator(cfg, broker, clock)
    devices = Devices(broker.connect("devices"), cfg, {c: "masked" for c in CLIENTS})  # the masked step stays open
    devices.join()
    broker.pump()
    sa = _steps(agg)
    assert sa is not None and sa.step == "masked"
    before = (dict(sa.server.keys), dict(sa.sent_shares), dict(sa.server.masked))
    run = devices.runs["d0"]
    bad = [
        ("d0", SaMasked(np.zeros(3, np.uint32))),  # the wrong length
        ("d0", run.keys()),  # the keys step is closed
        ("d0", SaShares([b"x" * 80])),  # the shares step too
        ("d0", SaRoster({}, t=1, frac_bits=1, bound=1.0, weighted=False)),  # a server's kind, on up/
    ]
    for client, msg in bad:
        devices.send(client, msg, 1, "train")
    devices.t.publish(topics.up(FED, "zz"), encode_message(run.keys(), fed=FED, sender="zz", round=1, phase="train"))
    broker.pump()
    assert agg.dropped == {"invalid": 1, "stale": 2, "unexpected_kind": 1, "unknown_client": 1}, agg.dropped
    assert (dict(sa.server.keys), dict(sa.sent_shares), dict(sa.server.masked)) == before


def test_a_key_that_agrees_no_secret_is_refused_at_the_keys_step() -> None:
    # The all-zero X25519 key is a low-order point: every share encrypted to it and every mask agreed with it would
    # fail, wrecking its neighbours' steps; refused when it is advertised.
    run = secagg_run.SecAggRun(_cfg(), 5, FED, 1, Phase.TRAIN, secagg_run.SumSlot(("0", "acc"), True))
    good = DeviceSecAgg("d1", FED, 1, "train", None).keys()
    assert run.refusal("d0", SaKeys(bytes(32), good.s)) == (
        "invalid",
        "sa_keys from d0: a key that agrees no secret (a low-order point): every neighbour's share to it would fail",
    )
    assert run.refusal("d1", good) is None


def test_a_device_names_its_neighbours_by_their_place_in_its_roster_only() -> None:
    # After the roster no message names a device: positions past the roster's end are refused by the device.
    cfg = _cfg()
    plan = RoundPlan.from_config(cfg)
    run = DeviceSecAgg("d0", FED, 1, "train", _table(0, 1))
    peers = {f"d{i}": DeviceSecAgg(f"d{i}", FED, 1, "train", None).keys() for i in (1, 2)}
    roster = SaRoster({v: (k.c, k.s) for v, k in peers.items()}, t=2, frac_bits=16, bound=1e4, weighted=True)
    shares = run.answer(roster, plan.num_classes, plan.proto_width)
    assert isinstance(shares, SaShares) and len(shares.boxes) == 2  # one box per neighbour, in the roster's order
    with pytest.raises(secagg.SecAggError, match="position 2, past the 2 of the roster"):
        run.answer(SaRouted([2], [b"x" * 80]), plan.num_classes, plan.proto_width)


def _adapters(round_: int = 1) -> dict[str, ParamsUpload]:
    """Each device's FedAvg upload of the adapter (dims from SMALL): values near 0.1, sample counts 20-70."""
    dim = initial_adapter(adapter_layout(SMALL["proto_dim"], SMALL["adapter_rank"], SMALL["num_classes"]), 0).size
    rng = np.random.default_rng(round_)
    return {
        c: ParamsUpload(rng.normal(0.1, 0.3, dim).astype(np.float32), 20 + 10 * i, round_, dt="f2" if i % 2 else "f4")
        for i, c in enumerate(CLIENTS)
    }


def _fedavg(secure: bool = True) -> FederationConfig:
    return make_config("fedavg", **{**SMALL, "federate": "adapter", "secagg": secure})


@pytest.mark.parametrize(
    "drop", [{}, {"d1": "masked", "d4": "unmask"}, {"d0": "keys", "d2": "shares"}], ids=["none", "two_mid", "two_early"]
)
def test_a_fedavg_adapter_sum_unmasks_to_the_plain_weighted_mean_with_devices_dropped(drop: dict[str, str]) -> None:
    # FedAvg's dense adapter under secure aggregation: each device masks [vector * n, n] (f4 or f2 as it would have
    # sent it); the server unmasks the sum and folds it as the plain run's weighted mean.
    vectors = _adapters()
    agg, _, _ = _run(drop, cfg=_fedavg(), vectors=vectors)
    senders = [c for c in CLIENTS if c not in drop or drop[c] == "unmask"]
    assert agg.records[0].clients == senders
    plain = _plain_run(_fedavg(secure=False), {c: vectors[c] for c in senders})
    got, want = agg.model.rules.state_values()["adapter"], plain.model.rules.state_values()["adapter"]
    sent = vectors["d0"].update
    assert isinstance(sent, np.ndarray) and got.shape == want.shape == sent.shape
    # f = 15 for 6 values within +-1e4: each n * v off by 2^-16, the weighted mean (sum n >= 150) by far less
    np.testing.assert_allclose(got, want, atol=1e-5)
