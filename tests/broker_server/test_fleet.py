"""A fleet that lives (issue 45): one `protofl-server fleet` process, its own secured Mosquitto and credentials,
three `protofl-edge join` processes started once with the files the fleet wrote, and two different runs submitted
with `protofl-server run submit`, served back to back; the fleet server killed with SIGKILL during the second."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from broker_server.core.durable import journal_records
from broker_server.core.member_log import LINES_PER_MINUTE
from broker_server.ops.broker import MosquittoBroker, free_port
from broker_server.ops.device_logs import FILE_CAP
from tests.broker_server.crash_helpers import env
from tests.broker_server.fleet_helpers import RUN_SETTINGS, Fleet, join_command, server_cli, wait_for

DEVICES = [f"device-{i}" for i in range(1, 4)]
SECOND = ["--preset", "fedproto", "--rounds", "3", "--min-clients", "3", "--set", 'archs=["cnn"]']


def model(state: Path) -> dict[str, np.ndarray]:
    with np.load(state / "server_model.npz", allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def reference(root: Path, url: str) -> list[subprocess.Popen[bytes]]:
    """The second run uninterrupted, as a plain `start` with the same settings and device ids."""
    root.mkdir()
    server = [sys.executable, "-m", "broker_server.cli", "start", "--broker", url, "--fed", "ref"]
    server += ["--state-dir", str(root / "state"), *SECOND, *RUN_SETTINGS]
    with (root / "server.log").open("ab") as out:
        procs = [subprocess.Popen(server, stdout=out, stderr=subprocess.STDOUT, env=env())]
    for i, device in enumerate(DEVICES):
        cmd = join_command(url, i, len(DEVICES), ["--fed", "ref", "--client-id", device])
        with (root / f"{device}.log").open("ab") as out:
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env()))
    return procs


def run_server_pid(fleet_pid: int) -> int:
    """The fleet server's child that serves the current run (0 if none)."""
    try:
        kids = Path(f"/proc/{fleet_pid}/task/{fleet_pid}/children").read_text().split()
    except OSError:
        return 0
    for pid in map(int, kids):
        try:
            if b"--fleet-run" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            continue
    return 0


@pytest.mark.slow
@pytest.mark.mosquitto
def test_two_runs_back_to_back_on_one_fleet_and_a_kill_during_the_second(
    tmp_path: Path, mosquitto_module: MosquittoBroker
) -> None:
    ref = reference(tmp_path / "ref", mosquitto_module.url)
    fleet = Fleet(tmp_path, free_port(), len(DEVICES))
    try:
        fleet.start()
        agents = [fleet.join(device, i, len(DEVICES)) for i, device in enumerate(DEVICES)]
        fleet.submit("first", "--preset", "tinyproto", "--rounds", "2", "--min-clients", "3", "--set", 'archs=["mlp"]')
        fleet.submit("second", *SECOND)
        listed = server_cli("run", "list", "--fleet", str(fleet.state)).stdout
        assert "first" in listed and "second" in listed, listed
        fleet.wait_state("first", "finished", 180)
        # The second run is under way: device-3 frozen (SIGSTOP, not a restart) holds it mid-run, then the fleet
        # server and its run's server are killed with SIGKILL once the run's journal holds its inputs.
        fleet.wait_state("second", "running", 60)
        agents[2].send_signal(signal.SIGSTOP)
        journal = fleet.run_dir("second") / "aggregator"
        wait_for(lambda: len(journal_records(journal)) >= 2, 120, "the second run's journal", fleet.tail)
        assert fleet.server is not None
        child = run_server_pid(fleet.server.pid)
        fleet.server.send_signal(signal.SIGKILL)
        fleet.server.wait()
        wait_for(lambda: not Path(f"/proc/{child}/cmdline").exists() or child == 0, 30, "the run server's death")
        fleet.start()  # the same command again: the run it died under resumes
        agents[2].send_signal(signal.SIGCONT)
        fleet.wait_state("second", "finished", 180)
        for p in ref:
            assert p.wait(180) == 0, (tmp_path / "ref" / "server.log").read_text()[-3000:]
        # No device was restarted, and each served both runs and waits for the next.
        for device, agent in zip(DEVICES, agents, strict=True):
            assert agent.poll() is None, fleet.tail()
            text = (fleet.logs / f"{device}.log").read_text()
            for run in ("first", "second"):
                assert f"run '{run}' finished" in text, text[-3000:]
        first, second = fleet.run_dir("first"), fleet.run_dir("second")
        for run_dir in (first, second):
            for path in ("server_model.npz", "artifacts/manifest.json", "rounds.jsonl", "report/summary.md"):
                assert (run_dir / path).exists(), path
        assert [json.loads(x)["preset"] for x in (first / "rounds.jsonl").read_text().splitlines()] == ["tinyproto"] * 2
        rows = [json.loads(x) for x in (second / "rounds.jsonl").read_text().splitlines()]
        assert [r["round"] for r in rows] == [1, 2, 3] and all(r["clients"] == DEVICES for r in rows), rows
        assert "resumed federation" in (second / "server.log").read_text()
        # Crash exact: the killed run ends with the uninterrupted run's model, every upload journaled once.
        uploads = [(r.client, r.round, r.kind) for r in journal_records(journal) if r.kind == "protos"]
        assert sorted(uploads) == sorted({(d, r, "protos") for d in DEVICES for r in (1, 2, 3)})
        got, want = model(second), model(tmp_path / "ref" / "state")
        assert sorted(got) == sorted(want)
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
        listed = server_cli("run", "list", "--fleet", str(fleet.state)).stdout
        assert "first" in listed.split("\n")[0] and "finished" in listed, listed
    finally:
        fleet.stop()
        for p in ref:
            if p.poll() is None:
                p.kill()


def flood(fleet: Fleet, device: str, lines: int) -> None:
    """`lines` log lines as fast as the broker takes them, on `device`'s log topic with its credentials."""
    from protofl import topics
    from protofl.transport.broker_url import parse_broker_url
    from protofl.transport.credentials import read_device_file
    from protofl.transport.mqtt import MqttTransport
    from protofl.wire import Status, encode_message

    cred = read_device_file(fleet.credentials(device)).credentials
    t = MqttTransport(parse_broker_url(fleet.url).with_auth(cred.username, cred.password), device)
    t.connect(10)
    try:
        for i in range(lines):
            msg = Status(state="error", detail=f"flood {i} " + "x" * 900)
            t.publish(topics.device_log("default", device), encode_message(msg, fed="default", sender=device), qos=1)
        t.flush(30)
    finally:
        t.close()


def connect_refused(url: str, credentials: Path, client_id: str) -> str:
    """Connect with a device's credentials file: '' when the broker takes it, else its refusal."""
    from protofl.transport.broker_url import parse_broker_url
    from protofl.transport.credentials import read_device_file
    from protofl.transport.mqtt import MqttTransport, TransportError

    cred = read_device_file(credentials).credentials
    t = MqttTransport(parse_broker_url(url).with_auth(cred.username, cred.password), client_id + "-probe")
    try:
        t.connect(5)
    except (TransportError, TimeoutError) as exc:
        return str(exc)
    finally:
        t.close()
    return ""


@pytest.mark.slow
@pytest.mark.mosquitto
def test_a_device_enrolled_and_another_revoked_on_a_running_fleet(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, free_port(), 3)
    try:
        fleet.start()
        agents = [fleet.join(device, i, 4) for i, device in enumerate(DEVICES)]
        connected = [fleet.logs / f"{device}.log" for device in DEVICES]  # all three wait for a run first
        wait_for(lambda: all("connected to" in f.read_text() for f in connected), 120, "the devices", fleet.tail)
        # Rounds of 0.1 s close at quorum (two devices) without a device that joins late: enough of them that
        # device-3 is in the run's rounds before they are over (it joins the round after its join arrives).
        rounds_n = 30
        fleet.submit(
            "live", "--preset", "tinyproto", "--rounds", str(rounds_n), "--min-clients", "2", "--set", 'archs=["mlp"]'
        )
        rounds = fleet.run_dir("live") / "rounds.jsonl"

        def logged() -> list[dict[str, Any]]:
            return [json.loads(x) for x in rounds.read_text().splitlines()] if rounds.exists() else []

        wait_for(lambda: any("device-3" in r["clients"] for r in logged()), 120, "a round with device-3", fleet.tail)
        assert len(logged()) < rounds_n, f"the run ended before device-3 could be frozen in it: {logged()}"
        # device-3 frozen: the open round waits for it (its deadline is 120 s) until it is revoked.
        agents[2].send_signal(signal.SIGSTOP)
        old = fleet.credentials("device-3").read_text()
        (tmp_path / "device-3.json").write_text(old)
        added = server_cli("devices", "add", "device-4", "--fleet", str(fleet.state)).stdout
        assert "device-4: enrolled" in added, added
        flood(fleet, "device-4", 2000)  # before device-4 joins: a hostile device-4 floods its log topic
        logs = fleet.state / "device-logs" / "device-4.log"
        wait_for(
            lambda: logs.exists() and logs.read_text().count("flood") >= LINES_PER_MINUTE, 60, "the flood", fleet.tail
        )
        fleet.join("device-4", 3, 4)
        log = fleet.run_dir("live") / "server.log"
        wait_for(lambda: "device device-4 joined" in log.read_text(), 120, "device-4's join", fleet.tail)
        server_cli("devices", "revoke", "device-3", "--fleet", str(fleet.state))
        assert not fleet.credentials("device-3").exists()
        listed = server_cli("devices", "list", "--fleet", str(fleet.state)).stdout
        assert "device-4 enrolled" in listed and "device-3 revoked" in listed, listed
        fleet.wait_state("live", "finished", 120)
        agents[2].send_signal(signal.SIGCONT)
        rows: list[dict[str, Any]] = logged()
        assert [r["round"] for r in rows] == list(range(1, rounds_n + 1))
        # device-4 took part from a round on; the rounds after the revocation closed without device-3.
        assert "device-4" in rows[-1]["clients"] and "device-3" not in rows[-1]["clients"], rows
        assert rows[-1]["clients"] == ["device-1", "device-2", "device-4"], rows
        assert all(r["closed_by"] != "deadline" for r in rows), rows  # the revoked device held no round open
        refusal = connect_refused(fleet.url, tmp_path / "device-3.json", "device-3")
        assert "authori" in refusal.lower(), refusal
        assert connect_refused(fleet.url, fleet.credentials("device-4"), "device-4") == ""
        assert "device device-3 revoked" in log.read_text(), log.read_text()[-3000:]
        # Device logs at the server: device-1's own lines; the flood bounded (30 lines a minute, 256 KB a file).
        shown = server_cli("logs", "device-1", "--fleet", str(fleet.state)).stdout
        assert "protofl.edge: device-1: trained, uploaded" in shown, shown[-2000:]
        kept = logs.read_text()
        assert kept.count("flood") == LINES_PER_MINUTE and logs.stat().st_size <= FILE_CAP, kept[-2000:]
    finally:
        fleet.stop()
