"""No member stalls or steers secure aggregation (issue 58), in process (the aggregator as `start` runs it over the
in-process broker; the devices the agent's secure-aggregation half, tests/broker_server/test_secagg_rounds.py):
who leaves the sum when boxes do not decrypt, a step that cannot complete closing at its deadline (also after a
restart), and an unmasked sum that clipped inputs cannot give refused. The same through real processes and
Mosquitto: test_secagg_stall.py."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from broker_server.core.secagg_run import exclusions
from broker_server.core.shell import Aggregator
from protofl.config import FederationConfig
from protofl.errors import WireError
from protofl.transport import InProcessBroker, Transport
from protofl.wire import SaMasked, SaRouted, SaShares, decode_message, encode_message
from tests.broker_server.test_restart_presence import Clock
from tests.broker_server.test_secagg_rounds import CLIENTS, FED, Devices, _aggregator, _cfg, _plain, _protos, _steps


def test_who_leaves_the_sum_over_the_accusations() -> None:
    # t = 3. d5 named by d0, d1, d2 (3 >= t): it leaves, its accusers stay. d4 named by d3 only: d3 leaves instead
    # (as if it had dropped), and so does a member naming four others that nobody else names (d0 in the second).
    assert exclusions({"d0": frozenset({"d5"}), "d1": frozenset({"d5"}), "d2": frozenset({"d5"})}, 3) == {
        "d5": "its shares do not decrypt at 3 neighbour(s) (d0, d1, d2)"
    }
    assert exclusions({"d3": frozenset({"d4"})}, 3) == {"d3": "it named d4, whom fewer than t = 3 neighbours named"}
    liar = exclusions({"d0": frozenset({"d1", "d2", "d3", "d4"})}, 3)
    assert list(liar) == ["d0"]  # no more than it could exclude by dropping out itself
    # Two colluders (fewer than t) naming the same honest member exclude only themselves.
    assert set(exclusions({"d0": frozenset({"d2"}), "d1": frozenset({"d2"})}, 3)) == {"d0", "d1"}


class Garbling(Devices):
    """`garble`: a member whose share boxes decrypt at no neighbour; `spoil`: (reader, sender) whose one routed box
    arrives broken (the reader names the sender alone); `garbage`: a member sending a random masked vector; `lose`:
    (member, round) whose masked input of that round never comes (restarted after its shares)."""

    def __init__(
        self,
        transport: Transport,
        cfg: FederationConfig,
        *,
        garble: str = "",
        spoil: tuple[str, str] = ("", ""),
        garbage: str = "",
        lose: tuple[str, int] = ("", 0),
    ) -> None:
        super().__init__(transport, cfg, {})
        self.garble, self.spoil, self.garbage, self.lose = garble, spoil, garbage, lose

    def send(self, client: str, msg: object, round_: int = 0, phase: str = "") -> None:
        if (client, round_) == self.lose and isinstance(msg, SaMasked):
            return
        if client == self.garble and isinstance(msg, SaShares):
            msg = SaShares([os.urandom(len(b)) for b in msg.boxes])
        if client == self.garbage and isinstance(msg, SaMasked):
            msg = SaMasked(np.asarray(np.random.default_rng(7).integers(0, 2**32, msg.y.shape[0], dtype=np.uint32)))
        super().send(client, msg, round_, phase)

    def _down(self, topic: str, payload: bytes) -> None:
        env, msg = decode_message(payload)
        reader, sender = self.spoil
        if isinstance(msg, SaRouted) and topic.endswith("/" + reader):
            order = sorted(set(CLIENTS) - {reader})
            boxes = [b"\0" * len(b) if order[p] == sender else b for p, b in zip(msg.senders, msg.boxes, strict=True)]
            payload = encode_message(
                SaRouted(msg.senders, boxes), fed=FED, sender="server", round=env.round, phase=env.phase
            )
        super()._down(topic, payload)


def _garbled_run(cfg: FederationConfig | None = None, **kw: Any) -> tuple[Aggregator, int]:
    """A run of `Garbling` devices; the number of deadlines it took (each step that waited: one)."""
    cfg, broker, clock = cfg or _cfg(), InProcessBroker(), Clock()
    agg, _ = _aggregator(cfg, broker, clock)
    devices = Garbling(broker.connect("devices"), cfg, **kw)
    devices.join()
    deadlines = 0
    broker.pump()
    while not agg.finished and deadlines < 8:
        clock.now += 61.0
        agg.tick()
        broker.pump()
        deadlines += 1
    assert agg.finished
    return agg, deadlines


def test_a_member_whose_boxes_do_not_decrypt_is_named_left_out_and_the_round_completes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, "protofl.server"):  # (start_cli sets this logger itself)
        agg, waited = _garbled_run(garble="d5")
    assert waited == 0  # every step closed at its quorum
    named = [r for r in caplog.records if "d5 is left out of the sum" in r.getMessage()]
    assert named and named[0].levelno == logging.WARNING
    assert "its shares do not decrypt at 5 neighbour(s) (d0, d1, d2, d3, d4)" in named[0].getMessage()
    senders = CLIENTS[:5]
    assert agg.records[0].clients == senders
    got, want = _protos(agg), _plain(senders)
    assert sorted(got) == sorted(want)
    for c in want:
        np.testing.assert_allclose(got[c], want[c], atol=2e-4)


def test_a_lone_accuser_leaves_in_place_of_the_member_it_names(caplog: pytest.LogCaptureFixture) -> None:
    # d0 cannot open d3's box (broken on the way): it names d3, nobody else does, so d0 leaves; d3's mask with d0
    # is removed from d0's key's shares.
    with caplog.at_level(logging.INFO, "protofl.server"):  # (start_cli sets this logger itself)
        agg, waited = _garbled_run(spoil=("d0", "d3"))
    assert any("d0 is left out of the sum: it named d3" in r.getMessage() for r in caplog.records)
    senders = CLIENTS[1:]
    assert agg.records[0].clients == senders
    got, want = _protos(agg), _plain(senders)
    for c in want:
        np.testing.assert_allclose(got[c], want[c], atol=2e-4)


def test_a_garbage_masked_vector_is_refused_naming_the_round_and_the_global_state_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, "protofl.server"):  # (start_cli sets this logger itself)
        agg, waited = _garbled_run(garbage="d2")
    refused = [r for r in caplog.records if "round 1 secure aggregation: the unmasked sum of 6" in r.getMessage()]
    assert refused and refused[0].levelno == logging.WARNING, [r.getMessage() for r in caplog.records]
    assert "is not one their clipped inputs can give" in refused[0].getMessage()
    assert not any("unmasked the sum" in r.getMessage() for r in caplog.records)
    assert _protos(agg) == {}  # nothing folded: the global state (none yet) kept


def test_a_step_that_cannot_complete_closes_at_its_deadline_and_the_next_round_starts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # min_clients = the fleet, d1 restarted after its shares (it never sends its masked input of round 1): the
    # masked step closes at its deadline, round 1 folds nothing and says so; round 2 runs with everybody.
    cfg = _cfg(rounds=2, min_clients=6)
    with caplog.at_level(logging.INFO, "protofl.server"):  # (start_cli sets this logger itself)
        agg, waited = _garbled_run(cfg, lose=("d1", 1))
    assert waited == 1  # the masked step's deadline, once
    said = [r.getMessage() for r in caplog.records]
    assert any("round 1 secure aggregation: the masked step has 5 device(s), 6 needed" in m for m in said), said
    assert any("round 2 secure aggregation: unmasked the sum of 6 device(s)" in m for m in said), said
    assert not any("waiting another" in m for m in said)
    assert len(agg.records) == 2 and agg.records[1].clients == CLIENTS


def test_a_server_restarted_mid_phase_does_not_bring_the_stall_back(tmp_path: Path) -> None:
    cfg, broker, clock = _cfg(rounds=2, min_clients=6), InProcessBroker(), Clock()
    live, durable = _aggregator(cfg, broker, clock, tmp_path / "live")
    devices = Devices(broker.connect("devices"), cfg, {"d1": "masked"})
    devices.join()
    broker.pump()
    assert (sa := _steps(live)) is not None and sa.step == "masked"
    shutil.copytree(tmp_path / "live", tmp_path / "cut")  # a kill -9 in the masked step
    assert durable is not None
    durable.close()
    clock2, broker2 = Clock(), InProcessBroker()
    agg, d = _aggregator(cfg, broker2, clock2, tmp_path / "cut")  # the journal replays into the masked step
    for _ in range(4):
        clock2.now += 61.0
        agg.tick()
    assert agg.round == 2 and not agg.finished and agg.records[0].round == 1  # round 1 closed, round 2 open
    assert d is not None
    d.close()


def test_blame_travels_as_packed_positions_only_where_it_names_somebody() -> None:
    plain = SaMasked(np.array([1, 2], dtype=np.uint32))
    named = SaMasked(np.array([1, 2], dtype=np.uint32), blame=[0, 9])
    assert "blame" not in plain.to_body() and named.to_body()["blame"] == bytes([0b1, 0b10])  # bits 0 and 9
    assert SaMasked.from_body(named.to_body()).blame == [0, 9]
    with pytest.raises(WireError, match="blame: names nobody"):
        SaMasked.from_body({**plain.to_body(), "blame": b""})
