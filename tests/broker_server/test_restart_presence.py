"""A restart keeps every device's place (issue 24): presence and timers journaled, graces measured from the
resume, the wills a dying broker publishes not taken as departures, `--min-clients` a floor for every close.

In process (InProcessBroker) with a clock the test moves, so that "after the grace" is a number, not a sleep.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from broker_server.core.durable import DurableState, journal_records
from broker_server.core.rounds import OFFLINE_GRACE_S, RESUME_GRACE_S
from broker_server.core.shell import Aggregator
from protofl import topics
from protofl.presets import make_config
from protofl.transport import InProcessBroker
from protofl.wire import Join, Message, ProtoSet, ProtoUpload, Status, encode_message

FED = "rp"
IDS = ["a", "b", "c"]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Run:
    """One server process over a state dir: an aggregator, its durable state and an in-process broker."""

    def __init__(self, state: Path, clock: Clock, min_clients: int = 3) -> None:
        cfg = make_config(
            "fedproto",
            rounds=3,
            num_classes=2,
            proto_dim=2,
            adapter_rank=1,
            min_clients=min_clients,
            round_timeout=600.0,
        )
        self.broker = InProcessBroker()
        self.agg = Aggregator(cfg, FED, self.broker.connect("server"), clock=clock)
        self.durable = DurableState(state, FED)
        self.durable.bind(self.agg)
        self.agg.start(resume=self.durable.restore())

    def send(self, cid: str, msg: Message, round_: int = 0, phase: str = "", topic: str = "") -> None:
        payload = encode_message(msg, fed=FED, sender=cid, round=round_, phase=phase)
        self.broker.connect(cid).publish(topic or topics.up(FED, cid), payload)
        self.broker.pump()

    def join(self, cid: str) -> None:
        self.send(cid, Join(arch="", n_samples=3))

    def upload(self, cid: str, round_: int) -> None:
        ps = ProtoSet(classes=np.array([0]), values=np.full((1, 2), ord(cid[0]), np.float32), counts=np.array([3]))
        self.send(cid, ProtoUpload(local=ps, public=None, n_samples=3), round_, "train")

    def presence(self, cid: str, state: str) -> None:
        self.send(cid, Status(state=state, detail=""), topic=topics.presence(FED, cid))

    def crash(self) -> None:
        self.durable.close()


def restarted_after_a_first_upload(state: Path, clock: Clock, downtime: float = 0.0) -> Run:
    """All three joined, a uploaded in round 1, the server crashed and came back `downtime` later."""
    run = Run(state, clock, min_clients=2)
    for c in IDS:
        run.join(c)
    run.upload("a", 1)
    run.crash()
    clock.now += downtime
    return Run(state, clock, min_clients=2)


def test_a_dying_brokers_wills_do_not_drop_devices_that_come_back(tmp_path: Path) -> None:
    # The server dies, its broker publishes every device's will ("offline") and saves it; the restarted
    # server reads them first. Devices whose reconnect backoff is longer than the offline grace must keep
    # their place: the round closes with all three, as it would have without the crash.
    clock = Clock()
    run = restarted_after_a_first_upload(tmp_path, clock, downtime=20)
    for c in IDS:
        run.presence(c, "offline")  # the retained wills
    clock.now += OFFLINE_GRACE_S + 10  # a backoff longer than the grace
    run.agg.tick()
    assert sorted(run.agg.clients) == IDS  # nobody left
    run.presence("b", "online")
    run.upload("b", 1)
    assert run.agg.round == 1  # still waiting for c, though a and b sent and min_clients is 2
    run.presence("c", "online")
    run.upload("c", 1)
    assert run.agg.records[0].clients == IDS and run.agg.records[0].closed_by == "quorum"


def test_a_device_that_never_comes_back_leaves_after_the_resume_grace(tmp_path: Path) -> None:
    clock = Clock()
    run = restarted_after_a_first_upload(tmp_path, clock)
    run.presence("c", "offline")
    run.presence("b", "online")
    run.upload("b", 1)
    clock.now += RESUME_GRACE_S - 1
    run.agg.tick()
    assert "c" in run.agg.clients and run.agg.round == 1
    clock.now += 2
    run.agg.tick()
    assert "c" not in run.agg.clients
    assert run.agg.records[0].clients == ["a", "b"] and run.agg.round == 2


def test_a_grace_is_measured_from_the_resume_not_stored_as_a_time(tmp_path: Path) -> None:
    clock = Clock()
    run = Run(tmp_path, clock)
    for c in IDS:
        run.join(c)
    run.presence("c", "offline")  # c's grace starts; the server crashes inside it
    run.crash()
    clock.now += 600  # a long downtime: a stored deadline would have passed long ago
    run = Run(tmp_path, clock)
    run.agg.tick()
    assert "c" in run.agg.clients  # still in its grace, counted from the resume
    run.presence("c", "online")
    for c in IDS:
        run.upload(c, 1)
    assert run.agg.records[0].clients == IDS


def test_min_clients_is_a_floor_for_a_round_that_every_remaining_device_finished(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    run = Run(tmp_path, clock, min_clients=3)
    for c in IDS:
        run.join(c)
    run.presence("c", "offline")
    clock.now += OFFLINE_GRACE_S + 1
    run.agg.tick()
    assert "c" not in run.agg.clients  # c left the round
    with caplog.at_level(logging.WARNING, logger="protofl.server"):
        run.upload("a", 1)
        run.upload("b", 1)
    assert run.agg.round == 1 and not run.agg.records  # 2 < --min-clients 3: no "quorum" close
    assert "fewer than --min-clients 3: waiting" in caplog.text
    clock.now += 601
    run.agg.tick()
    assert run.agg.round == 1 and not run.agg.records  # nor at the deadline: it waits another round_timeout
    run.presence("c", "online")
    run.upload("c", 1)
    assert run.agg.records[0].clients == IDS and run.agg.records[0].closed_by == "quorum"


def test_a_devices_return_is_journaled_so_its_upload_survives_a_restart(tmp_path: Path) -> None:
    clock = Clock()
    run = Run(tmp_path, clock, min_clients=2)
    for c in IDS:
        run.join(c)
    run.presence("c", "offline")
    clock.now += OFFLINE_GRACE_S + 1
    run.agg.tick()  # c departs (a journaled timer)
    run.presence("c", "online")  # and comes back after the last checkpoint (a journaled return)
    run.upload("c", 1)
    assert run.agg.dropped == {}
    kinds = [r.kind for r in journal_records(tmp_path / "")]
    assert kinds.count("grace_over") == 1 and kinds.count("status") == 2
    run.crash()
    run = Run(tmp_path, clock, min_clients=2)
    assert run.agg.dropped == {} and "c" in run.agg.clients  # replayed: not an unknown client
    run.upload("a", 1)
    run.upload("b", 1)
    assert run.agg.records[0].clients == IDS


def test_a_missing_checkpoint_is_said_and_the_journal_rebuilds_the_federation(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    run = Run(tmp_path, clock)
    for c in IDS:
        run.join(c)
    for c in IDS:
        run.upload(c, 1)
    run.crash()
    (tmp_path / "checkpoint.bin").unlink()
    with caplog.at_level(logging.WARNING, logger="protofl.durability"):
        run = Run(tmp_path, clock)
    assert f"no checkpoint in {tmp_path}" in caplog.text and "rebuilt the federation from its journal" in caplog.text
    assert run.agg.round == 2 and run.agg.records[0].clients == IDS
