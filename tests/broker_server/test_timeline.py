"""The per-device timeline: composed simulated times, first arrivals, rounds closed at quorum or deadline."""

from __future__ import annotations

import pytest

from broker_server.core.rounds import RoundRecord
from broker_server.simulation.links import Arrival, expand
from broker_server.simulation.timeline import timeline
from protofl.profiles import parse_fleet
from protofl.wire import Metrics

CLIENTS = ["client-000", "client-001"]
DEVICES = expand(parse_fleet("rpi4+lte,rpi3+nb-iot"), 2)


def metrics(recv: float, compute: float, release: float) -> Metrics:
    return Metrics(
        n_local=1,
        correct_local=1,
        n_test=0,
        correct_test=0,
        extra={
            "recv_t": recv,
            "compute_s": compute,
            "compute_cpu_s": compute / 4,
            "release_t": release,
            "overrun_s": 0.0,
            "upload_budget": 5000.0,
            "upload_fits": 1.0,
        },
    )


def test_composed_times_and_round_lengths() -> None:
    scale = 10.0
    # Round 1 opens at t=100 (real). client-000: message at 100.1, compute 2 s simulated, released at 100.3,
    # its upload in at 100.35 -> downlink 1 s, compute 2 s, upload 0.5 s: done at 3.5 simulated s.
    # client-001 re-sent its upload after a reconnect: the first copy counts (in at 100.9 -> upload 5 s).
    r1 = RoundRecord(round=1, clients=CLIENTS, started=100.0, ended=101.0, closed_by="quorum")
    arrivals = [
        Arrival("client-000", 1, "train", "protos", 2000, 100.35, "f4"),
        Arrival("client-001", 1, "train", "protos", 2200, 100.9, "q8"),
        Arrival("client-001", 1, "train", "protos", 2200, 101.5, "q8"),
    ]
    ms = {1: {"client-000": metrics(100.1, 2.0, 100.3), "client-001": metrics(100.2, 3.0, 100.4)}}
    # Round 2 closed at its deadline without client-001.
    r2 = RoundRecord(round=2, clients=["client-000"], started=102.0, ended=108.0, closed_by="deadline")
    out = timeline([r1, r2], CLIENTS, DEVICES, arrivals, ms, scale, deadline_s=60.0)
    d0, d1 = out["devices"][:2]
    assert (d0["downlink_s"], d0["compute_s"], d0["upload_s"]) == pytest.approx((1.0, 2.0, 0.5))
    assert abs(d0["done_s"] - 3.5) < 1e-9 and d0["in_time"] and d0["class"] == "rpi4+lte"
    # client-001: downlink 2 s + compute 3 s + upload (100.9 - 100.4) x 10 = 5 s -> 10 s
    assert abs(d1["done_s"] - 10.0) < 1e-9 and d1["uplink_bytes"] == 2200 and d1["resent_bytes"] == 2200
    assert d1["dt"] == "q8" and d1["budget_bytes"] == 5000 and d1["class"] == "rpi3+nb-iot"
    r1s, r2s = out["rounds"]
    assert abs(r1s["round_s"] - 10.0) < 1e-9  # at quorum: the last device done
    assert r1s["wall_round_s"] == pytest.approx(10.0)  # (101 - 100) x 10
    assert r2s["round_s"] == 60.0 and r2s["missed"] == ["client-001"] and r2s["closed_by"] == "deadline"
    assert abs(r2s["sim_time_s"] - 70.0) < 1e-9
    d3 = out["devices"][3]
    assert not d3["made_it"] and d3["done_s"] is None and not d3["in_time"]
    # The simulator held client-000's upload 0.03 s past its release for an earlier one (edge_agent/core/emulation.py
    # ReleaseOrder): this machine's time, not the link's - upload 0.5 -> 0.2 s, overrun 0 -> 0.3 s.
    held = timeline([r1], CLIENTS, DEVICES, arrivals, ms, scale, 60.0, {("client-000", 100.3): 0.03})["devices"][0]
    assert (held["upload_s"], held["overrun_s"], held["done_s"]) == pytest.approx((0.2, 0.3, 3.2))


def test_versions_and_deadlines_on_the_composed_clock() -> None:
    """Asynchronous versions (closed by the buffer) and a round closed at its deadline are timed on the composed
    clock, not by this machine's real time: a stale upload arrives from the opening of the version it trained
    from, a device busy with an older version starts the next one when it released that one, and a deadline
    that only this machine's late release hit does not count. Composed times in the comments."""
    c0, c1 = CLIENTS
    recs = [
        # v1 opens at 0: c0 1 + 2 + 0 -> 3 closes it (K = 1); c1 trains it too: 1 + 8 -> released 9, in at 10
        RoundRecord(round=1, clients=[c0], started=0.0, ended=50.0, closed_by="buffer"),
        # v2 opens at 3: c0 3 + 1 + 2 -> 6; the stale c1@1 (10) closes it: 7 s. c1, busy until 9, trains v2
        # from 9: released 11, in at 12
        RoundRecord(round=2, clients=[c0, f"{c1}@1"], started=50.0, ended=90.0, closed_by="buffer"),
        # v3 opens at 10: c1@2 at 12 closes it: 2 s (without the busy rule it would be in before v3 opened)
        RoundRecord(round=3, clients=[f"{c1}@2"], started=100.0, ended=120.0, closed_by="buffer"),
        # r4 opens at 12, both chosen: c0 12 + 1 + 2 -> 15; c1 15 + 6 up -> 21, late only in real time (its
        # release at 189): the round closed at the 60 s deadline in real time, on the composed clock after 9 s
        RoundRecord(round=4, clients=[c0], started=130.0, ended=190.0, closed_by="deadline", selected=[c0, c1]),
    ]
    arrivals = [
        Arrival(c0, 1, "train", "protos", 100, 3.0, "f4"),
        Arrival(c1, 1, "train", "protos", 100, 60.0, "f4"),
        Arrival(c0, 2, "train", "protos", 100, 53.0, "f4"),
        Arrival(c1, 2, "train", "protos", 100, 81.0, "f4"),
        Arrival(c0, 4, "train", "protos", 100, 133.0, "f4"),
        Arrival(c1, 4, "train", "protos", 100, 195.0, "f4"),
    ]
    ms = {
        1: {c0: metrics(1.0, 2.0, 3.0), c1: metrics(1.0, 8.0, 59.0)},
        2: {c0: metrics(51.0, 2.0, 53.0), c1: metrics(51.0, 2.0, 80.0)},
        4: {c0: metrics(131.0, 2.0, 133.0), c1: metrics(131.0, 2.0, 189.0)},
    }
    out = timeline(recs, CLIENTS, DEVICES, arrivals, ms, 1.0, deadline_s=60.0)
    assert [r["round_s"] for r in out["rounds"]] == pytest.approx([3.0, 7.0, 2.0, 9.0])
    assert [r["wall_round_s"] for r in out["rounds"]] == pytest.approx([50.0, 40.0, 20.0, 60.0])
    ms[4].pop(c1)  # c1's round 4 never timed: the deadline is what it was
    assert timeline(recs, CLIENTS, DEVICES, arrivals, ms, 1.0, deadline_s=60.0)["rounds"][3]["round_s"] == 60.0


def test_keepalive_outlasts_the_largest_transfer() -> None:
    from broker_server.simulation.links import Links
    from protofl.transport.broker_url import parse_broker_url

    links = Links(
        DEVICES, parse_broker_url("mqtt://127.0.0.1:1883"), time_scale=20.0, seed=0, largest_message=6_800_000
    )
    try:
        # nb-iot downlink 3400 B/s: 6.8 MB take 2000 simulated s = 100 real s at scale 20 -> 2 x 100 + 1
        assert links.broker_for(1).keepalive == 201
        assert links.broker_for(0).keepalive == 30  # lte: 6.8 MB in 1.8 s; the default 30 s is plenty
        assert links.broker_for(1).port == links.proxies[1].port
    finally:
        links.close()
