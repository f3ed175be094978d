"""The simulator's virtual clock (edge_agent/core/emulation.py `ReleaseOrder`, simulate `--sample-cost`): a run's
simulated times and the uploads each version folds do not depend on how this machine schedules the devices.

Asynchronous rounds (a version every 2 of 3 uploads: the Jetson's and the rpi4's, on the virtual clock) over a
fleet whose devices differ by their profiles: the compute from the profiles (`sample_cost_s` x samples / compute
factor), the links from theirs. The same run twice, once with the fastest device slowed on this machine (each round
message it handles waits 1.5 s of real time before training, longer than the rpi3's whole emulated round): in real
time its uploads now come after the rpi3's, on the virtual clock they keep their place. The times, the versions'
folds and the per-device rows are the same in both runs.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from broker_server.simulation import SimulationSpec, run_simulation
from edge_agent.core.agent import EdgeAgent

FLEET = "jetson-orin-nano+wifi:1,rpi4+lte:1,rpi3+lte:1"
SLOWED = "client-000"  # the Jetson: first on the virtual clock in every version (on real time, after the rpi3)
SLOW_S = 1.5


def run() -> dict[str, Any]:
    spec = SimulationSpec(
        preset="tinyproto",
        dataset="synthetic:n=300,n_test=30",
        clients=3,
        rounds=2,
        seed=1,
        transport="mqtt",
        agents="thread",
        profiles=FLEET,
        time_scale=1.0,
        sample_cost_s=0.002,  # seed 1's split: Jetson 0.03 s, rpi4 0.05 s, rpi3 1.0 s of compute
        overrides={"buffer_k": 2, "staleness_bound": 4, "round_timeout": 60.0},
        timeout=120,
    )
    return run_simulation(spec)["links"]


def times(links: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    rounds = [(r["round"], r["closed_by"], round(r["round_s"], 9), round(r["sim_time_s"], 9)) for r in links["rounds"]]
    rows = [
        (d["round"], d["client"], d["made_it"], *(round(d[k], 9) for k in ("downlink_s", "compute_s", "upload_s")))
        for d in links["devices"]
        if d["done_s"] is not None
    ]
    return rounds, rows


@pytest.mark.mosquitto
def test_simulated_times_do_not_move_with_this_machine_s_scheduling(monkeypatch: pytest.MonkeyPatch) -> None:
    quiet = run()
    receive = EdgeAgent.receive
    slowed: list[float] = []

    def slow(self: EdgeAgent, topic: str, payload: bytes, *, recv_t: float | None = None) -> Any:
        if self.client_id == SLOWED and topic.endswith("/round"):
            slowed.append(time.time())
            time.sleep(SLOW_S)  # this machine's delay, not the device's: its compute is the profile's
        return receive(self, topic, payload, recv_t=recv_t)

    monkeypatch.setattr(EdgeAgent, "receive", slow)
    loaded = run()
    assert len(slowed) >= 2  # the slowing acted in every version
    assert quiet["nominal_links"] and loaded["release_order"]["forced"] == 0
    assert times(loaded) == times(quiet)
    rounds, rows = times(quiet)
    assert len(rounds) == 2 and all(r[1] == "buffer" for r in rounds)
    # the slowed device's uploads were folded in every version, as on a machine that keeps up
    assert all(made for rnd, client, made, *_ in rows if client == SLOWED)
