"""When a round is shown and what its accuracies are (`broker_server.core.progress`), and the service's line."""

from __future__ import annotations

import pytest

from broker_server.core.progress import GRACE_S, RoundProgress, accuracies
from broker_server.core.shell import RoundRecord
from broker_server.service import round_line
from protofl.humanize import human_bytes
from protofl.wire import Metrics


def m(
    n_local: int,
    correct_local: int,
    n_test: int,
    correct_test: int,
    proto_local: int | None = None,
    proto_test: int | None = None,
) -> Metrics:
    return Metrics(
        n_local=n_local,
        correct_local=correct_local,
        n_test=n_test,
        correct_test=correct_test,
        proto_correct_local=proto_local,
        proto_correct_test=proto_test,
    )


def test_accuracies_by_hand() -> None:
    # Client a: 8/10 local, 30/100 test; client b: 1/30 local, 50/100 test.
    # local = (8 + 1) / (10 + 30) = 0.225 (sample-weighted); global = mean(0.3, 0.5) = 0.4.
    # Only b sent nearest-prototype counts: local proto = 15/30 = 0.5, global proto = 60/100 = 0.6.
    acc = accuracies([m(10, 8, 100, 30), m(30, 1, 100, 50, proto_local=15, proto_test=60)])
    assert acc == pytest.approx(
        {"local_acc": 0.225, "global_acc": 0.4, "local_proto_acc": 0.5, "global_proto_acc": 0.6}
    )
    # A field device reports no test set: it does not count toward the global mean.
    assert accuracies([m(4, 2, 0, 0), m(4, 4, 10, 5)])["global_acc"] == 0.5
    assert accuracies([]) == dict.fromkeys(("local_acc", "global_acc", "local_proto_acc", "global_proto_acc"))


def rec(r: int, clients: list[str], ended: float = 100.0) -> RoundRecord:
    return RoundRecord(
        round=r,
        clients=clients,
        uplink_bytes=3000,
        downlink_bytes=2 * 2**20,
        started=ended - 2.5,
        ended=ended,
        closed_by="quorum",
    )


def test_a_round_is_shown_when_every_participant_reported_in_order() -> None:
    shown: list[tuple[int, set[str]]] = []
    p = RoundProgress(lambda r, ms: shown.append((r.round, set(ms))))
    p.add_metrics("a", 1, m(1, 1, 1, 1))  # before its round's close is seen: kept
    p.round_end(rec(1, ["a", "b"]))
    p.round_end(rec(2, ["a"]))
    p.add_metrics("a", 2, m(1, 1, 1, 1))
    assert p.poll(100.0) == 0 and shown == []  # round 2 is complete, but round 1 waits for b
    p.add_metrics("b", 1, m(1, 0, 1, 0))
    assert p.poll(100.0) == 2 and shown == [(1, {"a", "b"}), (2, {"a"})]
    assert p.all_metrics_in() and p.pending == []


def test_a_round_is_shown_without_a_silent_client_after_the_grace_period() -> None:
    shown: list[int] = []
    p = RoundProgress(lambda r, ms: shown.append(r.round))
    p.round_end(rec(1, ["a", "b"], ended=100.0))
    p.add_metrics("a", 1, m(1, 1, 1, 1))
    p.poll(100.0 + GRACE_S - 0.1)
    assert shown == []
    p.poll(100.0 + GRACE_S)
    assert shown == [1] and not p.all_metrics_in()
    p.add_metrics("b", 1, m(1, 1, 1, 1))  # late: the row is out, but the run knows it arrived
    assert p.all_metrics_in()


def test_rounds_without_evaluation_do_not_wait() -> None:
    shown: list[int] = []
    p = RoundProgress(lambda r, ms: shown.append(r.round), eval_every=2, rounds=3)
    for r in (1, 2, 3):
        p.round_end(rec(r, ["a"]))
    p.poll(100.0)
    assert shown == [1]  # round 2 asks for metrics (every 2nd), round 3 too (the last)
    p.poll(0.0, force=True)
    assert shown == [1, 2, 3]


def test_service_line_shows_the_accuracies_that_were_reported() -> None:
    line = round_line(rec(2, ["a", "b"]), {"a": m(10, 8, 100, 30), "b": m(30, 1, 100, 50, 15, 60)}, rounds=5)
    assert line == (
        "round 2/5: 2 clients (quorum), local acc (own classes) 22.5%, local proto acc (own classes) 50.0%, "
        "global acc 40.0%, "
        "global proto acc 60.0%, up 2.9 KB, down 2.0 MB, 2.5 s"
    )
    assert round_line(rec(1, ["a"]), {}, rounds=1) == "round 1/1: 1 clients (quorum), up 2.9 KB, down 2.0 MB, 2.5 s"


def test_human_bytes() -> None:
    assert [human_bytes(n) for n in (0, 1023, 1024, 1536, 2**20, 5 * 2**30, 2**50)] == [
        "0 B",
        "1023 B",
        "1.0 KB",
        "1.5 KB",
        "1.0 MB",
        "5.0 GB",
        "1048576.0 GB",
    ]


def held(p: RoundProgress) -> int:
    """Metrics messages the progress holds on to, and the names it remembers (what a member could grow)."""
    return sum(len(ms) for ms in p._metrics.values()) + sum(len(c) for c in p._missing.values())


def test_metrics_are_kept_only_for_the_rounds_it_waits_for() -> None:
    shown: list[tuple[int, set[str]]] = []
    p = RoundProgress(lambda r, ms: shown.append((r.round, set(ms))))
    p.round_end(rec(1, ["a", "b"]))
    # A member floods rounds far ahead, and round 1 with repeats: none of it is more than one message.
    assert not any(p.add_metrics("a", r, m(1, 1, 1, 1)) for r in range(100_000, 110_000))
    for _ in range(1000):
        assert p.add_metrics("a", 1, m(1, 1, 1, 1))
    assert held(p) == 1
    assert p.add_metrics("a", 2, m(1, 1, 1, 1))  # the open round: its metrics may come before its close
    assert not p.add_metrics("a", 3, m(1, 1, 1, 1))  # not open yet
    assert held(p) == 2
    p.poll(100.0 + GRACE_S)  # round 1 goes out without b
    assert shown == [(1, {"a"})] and held(p) == 2  # round 2's metrics, and b still due for round 1
    assert not p.add_metrics("a", 1, m(1, 1, 1, 1))  # emitted, and a was not missing: nothing to keep
    assert p.add_metrics("b", 1, m(1, 1, 1, 1)) and held(p) == 1  # b's late report counts, then is forgotten
    assert not p.add_metrics("b", 1, m(1, 1, 1, 1))
    p.round_end(rec(2, ["a"]))
    p.poll(100.0)
    assert shown[-1] == (2, {"a"}) and held(p) == 0 and p.all_metrics_in()


def test_a_resumed_service_waits_for_the_round_it_resumed_in() -> None:
    shown: list[tuple[int, set[str]]] = []
    p = RoundProgress(lambda r, ms: shown.append((r.round, set(ms))))
    p.start_at(7)
    assert not p.add_metrics("a", 3, m(1, 1, 1, 1))  # shown by the process before the restart
    assert p.add_metrics("a", 7, m(1, 1, 1, 1))
    p.round_end(rec(7, ["a"]))
    assert p.poll(100.0) == 1 and shown == [(7, {"a"})]
