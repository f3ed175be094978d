"""Transport does not change results: each preset over Mosquitto ends with the in-process aggregate.

Agents seed training from (seed, client, round), so the only difference MQTT can make is the order in
which uploads are folded in: float64 sums in another order, then a float32 cast (~1e-7 relative).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from broker_server.core.shell import Aggregator
from broker_server.core.stages import ServerModel
from broker_server.ops.broker import MosquittoBroker
from broker_server.simulation import SimulationSpec, run_simulation
from protofl.presets import PRESETS
from protofl.transport.broker_url import parse_broker_url
from tests.pipelines import ADAPTER_PIPELINE, NO_FLOOR

FED: dict[str, Any] = dict(dataset="synthetic:n=600,n_test=100", clients=5, alpha=0.5, rounds=3, seed=2)
RTOL, ATOL = 1e-4, 1e-5


# The agent processes train single-threaded; the threads in this process do too.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def run(spec: SimulationSpec) -> tuple[dict[str, Any], ServerModel]:
    finished: list[Aggregator] = []
    report = run_simulation(spec, on_finish=finished.append)
    return report, finished[0].model


def assert_same_model(a: ServerModel, b: ServerModel) -> None:
    va, vb = a.rules.state_values(), b.rules.state_values()
    for name in ("adapter", "params", "unit"):
        x, y = va.get(name), vb.get(name)
        assert (x is None) == (y is None), name
        if x is not None and y is not None:
            np.testing.assert_allclose(y, x, rtol=RTOL, atol=ATOL, err_msg=name)
    pa, pb = va.get("prototypes", {}), vb.get("prototypes", {})
    assert sorted(pa) == sorted(pb)
    for c in pa:
        np.testing.assert_allclose(pb[c], pa[c], rtol=RTOL, atol=ATOL, err_msg=f"prototype {c}")


def assert_same_rounds(inproc: dict[str, Any], mqtt: dict[str, Any]) -> None:
    assert mqtt["simulation"]["transport"] == "mqtt"
    assert mqtt["dropped"] == {} == inproc["dropped"]
    for a, b in zip(inproc["rounds"], mqtt["rounds"], strict=True):
        # the same messages crossed the wire (uplink/downlink are counted from the encoded bytes)
        assert (b["round"], b["clients"], b["uplink_bytes"], b["downlink_bytes"]) == (
            a["round"],
            a["clients"],
            a["uplink_bytes"],
            a["downlink_bytes"],
        )
        assert b["local_acc"] == pytest.approx(a["local_acc"], abs=0.02)


@pytest.mark.slow
@pytest.mark.mosquitto
@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_over_mosquitto_matches_inprocess(preset: str, mosquitto_module: MosquittoBroker) -> None:
    inproc, expected = run(SimulationSpec(preset=preset, overrides=NO_FLOOR, **FED))
    # Agents as threads of this process (DeviceRunner, the same loop `protofl-edge join` runs).
    mqtt, got = run(
        SimulationSpec(
            preset=preset,
            transport="mqtt",
            agents="thread",
            timeout=180,
            broker=parse_broker_url(mosquitto_module.url),
            overrides=NO_FLOOR,
            **FED,
        )
    )
    assert_same_model(expected, got)
    assert_same_rounds(inproc, mqtt)


@pytest.mark.slow
@pytest.mark.mosquitto
def test_agents_as_separate_processes_match_inprocess(mosquitto_module: MosquittoBroker) -> None:
    # The mean pipeline with every stage on (ERPA's two phases, APUD sparse adapters, CPS + scaled prototypes
    # for the classes the public set lacks); one OS process per agent, each loading its own share
    # (`protofl-edge join --partition i/5`).
    every_stage = {**ADAPTER_PIPELINE, **NO_FLOOR, "erpa": True, "public_classes": (0, 1, 2, 3, 4)}
    inproc, expected = run(SimulationSpec(preset="protofl", overrides=every_stage, **FED))
    mqtt, got = run(
        SimulationSpec(
            preset="protofl",
            transport="mqtt",
            agents="process",
            timeout=240,
            broker=parse_broker_url(mosquitto_module.url),
            overrides=every_stage,
            **FED,
        )
    )
    used = mqtt["config"]["techniques"]
    assert used["erpa"]["erpa"] is True and used["apud"]["apud"] and used["cps"]["cps"]
    assert_same_model(expected, got)
    assert_same_rounds(inproc, mqtt)
