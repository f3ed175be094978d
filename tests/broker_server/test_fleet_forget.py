"""`protofl-server devices revoke --forget ID` unlearns a device exactly (issue 59, item 8): a ridge run served by
three devices, device-3 then revoked with --forget, and the same run served again by the two left: the first run's
global head, solved again without device-3's statistics, is the second run's, float32 for float32."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from broker_server.ops.broker import free_port
from protofl.artifacts import read_predictor
from tests.broker_server.fleet_helpers import Fleet, server_cli

DEVICES = ["device-1", "device-2", "device-3"]
RIDGE = ["--preset", "tinyproto", "--rounds", "2", "--set", "ridge=true", "--set", 'archs=["mlp"]']


def head(fleet: Fleet, run: str) -> tuple[np.ndarray, np.ndarray, dict[str, object]]:
    weight, bias, _, info = read_predictor(fleet.run_dir(run) / "artifacts" / "global" / "predictor.npz")
    return weight, bias, info


@pytest.mark.slow
@pytest.mark.mosquitto
def test_revoke_forget_gives_the_head_of_a_federation_that_never_had_the_device(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, free_port(), len(DEVICES))
    try:
        fleet.start()
        for i, device in enumerate(DEVICES):
            fleet.join(device, i, len(DEVICES))
        fleet.submit("all", *RIDGE, "--min-clients", "3")
        fleet.wait_state("all", "finished", 240)
        before, _, info = head(fleet, "all")
        assert info["devices"] == 3, info
        said = server_cli("devices", "revoke", "device-3", "--forget", "--fleet", str(fleet.state)).stdout
        assert "revoked device-3" in said, said
        assert "device-3 forgotten in run 'all': its global head solved again from 2 device(s)" in said, said
        fleet.submit("without", *RIDGE, "--min-clients", "2")
        fleet.wait_state("without", "finished", 240)
        rows = [json.loads(x) for x in (fleet.run_dir("without") / "rounds.jsonl").read_text().splitlines()]
        assert all(r["clients"] == ["device-1", "device-2"] for r in rows), rows
        weight, bias, info = head(fleet, "all")
        ref_weight, ref_bias, ref_info = head(fleet, "without")
        assert not np.array_equal(weight, before)  # device-3's statistics were in it
        assert weight.dtype == np.float32 and np.array_equal(weight, ref_weight), np.abs(weight - ref_weight).max()
        assert np.array_equal(bias, ref_bias), np.abs(bias - ref_bias).max()
        assert info["devices"] == ref_info["devices"] == 2 and info["samples"] == ref_info["samples"], (info, ref_info)
        assert info["forgotten"] == ["device-3"], info
        again = server_cli("devices", "revoke", "device-3", "--forget", "--fleet", str(fleet.state)).stdout
        assert "nothing to forget" in again, again  # forgotten once: the head stays as it is
        assert np.array_equal(head(fleet, "all")[0], weight)
    finally:
        fleet.stop()
