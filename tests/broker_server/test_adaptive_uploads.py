"""Adaptive uploads over shaped links: FedAvg (a small resnet8, 326 kB a model at f4) over NB-IoT.

Hand-computed (simulated seconds; nb-iot: 62.5 kbit/s = 7812.5 B/s up, 27.2 kbit/s = 3400 B/s down,
rtt 1.6 s): the round message carries the 326 kB model, ~96 s down; compute ~1 s (x86-cpu, factor 1);
an f4 upload then takes 326 kB / 7812.5 = 42 s: done at ~141 s, past a 120 s deadline. Adaptive, the
device may spend 0.8 x (120 - 96 - 1 - 1.6) s x 7812.5 B/s = ~134 kB: f2 (163 kB + headers) does not fit,
q8 (82 kB, ~10.5 s) does, done at ~109 s.
"""

from __future__ import annotations

from typing import Any

import pytest

from broker_server.simulation import SimulationSpec, run_simulation

FLEET = "x86-cpu+ethernet:1,x86-cpu+nb-iot:1"
# The server's deadline runs on real time (120 s / TIME_SCALE) while training takes real CPU time
# whatever the scale: the adaptive device is done at ~109 of 120 simulated s, so the real slack is
# 11 s / TIME_SCALE: 0.2 s at 50, 1.1 s at 10.
TIME_SCALE = 10.0


def run(adaptive: bool) -> dict[str, Any]:
    spec = SimulationSpec(
        preset="fedavg",
        dataset="synthetic:n=600,n_test=50",
        clients=2,
        rounds=1,
        seed=2,
        transport="mqtt",
        agents="thread",
        profiles=FLEET,
        time_scale=TIME_SCALE,
        adaptive=adaptive,
        overrides={"round_timeout": 120.0, "archs": ("resnet8",), "proto_dim": 32},
        timeout=90,
    )
    return run_simulation(spec)["links"]


@pytest.mark.slow
@pytest.mark.mosquitto
def test_adaptive_uploads_fit_their_budget_and_the_deadline() -> None:
    links = run(adaptive=True)
    rows = {d["link"]: d for d in links["devices"]}
    for d in rows.values():
        assert d["budget_bytes"] is not None and d["uplink_bytes"] <= d["budget_bytes"], d
    nb = rows["nb-iot"]
    assert nb["dt"] == "q8" and rows["ethernet"]["dt"] == "f4"  # the slow link steps down, the fast one not
    assert nb["in_time"], nb  # by the composed clock (the server's real-time verdict is `made_it`)


@pytest.mark.slow
@pytest.mark.mosquitto
def test_without_adaptive_uploads_nb_iot_misses_the_fedavg_deadline() -> None:
    links = run(adaptive=False)
    rows = {d["link"]: d for d in links["devices"]}
    nb = rows["nb-iot"]
    assert nb["budget_bytes"] is None and nb["dt"] in ("f4", None)
    assert not nb["made_it"] and not nb["in_time"], nb
    assert rows["ethernet"]["made_it"]
    (r1,) = links["rounds"]
    assert r1["closed_by"] == "deadline" and r1["missed"] == ["client-001"] and r1["round_s"] == 120.0
