"""Revocation that is final and said (issue 59, items 1-2), on one fleet: a member that leaves a retained join on its
own `up/` topic is no client of a later run (the run's server ignores it and clears it; on main c4fa1ae it became a
client of every later run, each round waiting for its deadline), before or after it is revoked; a device revoked
while frozen mid-round says it was revoked, says "uploaded" only of what the server took and exits with join's own
code (4); and `join --connect-timeout` holds whatever the clock (faketime with its monotonic clock faked too)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from broker_server.ops.broker import free_port
from edge_agent.join_cli import EXIT_REVOKED
from tests.broker_server.crash_helpers import env
from tests.broker_server.fleet_helpers import Fleet, server_cli, wait_for

LIBFAKETIME = next(iter(sorted(Path("/usr/lib").glob("*/faketime/libfaketime.so.1"))), None)
TINY = ["--preset", "tinyproto", "--min-clients", "2", "--set", 'archs=["mlp"]']


def retained_join(fleet: Fleet, device: str) -> None:
    """`device` (a hostile member, with its own credentials) leaves a valid join retained on its own `up/` topic."""
    from protofl import topics
    from protofl.transport.broker_url import parse_broker_url
    from protofl.transport.credentials import read_device_file
    from protofl.transport.mqtt import MqttTransport
    from protofl.wire import Join, encode_message

    cred = read_device_file(fleet.credentials(device)).credentials
    t = MqttTransport(parse_broker_url(fleet.url).with_auth(cred.username, cred.password), device)
    t.connect(10)
    try:
        join = encode_message(Join(arch="mlp", n_samples=50), fed="default", sender=device)
        t.publish(topics.up("default", device), join, retain=True, qos=1)
        assert t.flush(10)
    finally:
        t.close()


def rows(fleet: Fleet, run: str) -> list[dict[str, Any]]:
    path = fleet.run_dir(run) / "rounds.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def uploads_taken(fleet: Fleet, run: str, device: str) -> int:
    """The uploads of `device` the run's server accepted (its status file, written as they come)."""
    try:
        status = json.loads((fleet.run_dir(run) / "status.json").read_text())
    except (OSError, ValueError):  # not written yet, or being replaced
        return 0
    return sum(int(m["uploads"]) for m in status.get("members", []) if m["id"] == device)


@pytest.mark.slow
@pytest.mark.mosquitto
def test_a_retained_join_is_no_client_and_a_revoked_device_says_so_and_exits(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, free_port(), 3)
    try:
        fleet.start()
        frozen = fleet.join("device-1", 0, 2)
        fleet.join("device-2", 1, 2)
        retained_join(fleet, "device-3")  # device-3 never runs: only its retained join is on the broker
        fleet.submit("one", *TINY, "--rounds", "2")
        fleet.wait_state("one", "finished", 120)  # on main: each round waited device-3 out (120 s deadline)
        got = rows(fleet, "one")
        assert [r["clients"] for r in got] == [["device-1", "device-2"]] * 2, got
        assert all(r["closed_by"] != "deadline" for r in got), got
        said = (fleet.run_dir("one") / "server.log").read_text()
        assert "ignored and cleared a retained message on 'protofl/default/up/device-3'" in said, said[-3000:]
        assert "device device-3 joined" not in said, said[-3000:]
        # Left again, then revoked: no later run takes it back.
        retained_join(fleet, "device-3")
        server_cli("devices", "revoke", "device-3", "--fleet", str(fleet.state))
        fleet.submit("long", *TINY, "--rounds", "300")
        wait_for(lambda: len(rows(fleet, "long")) >= 2, 120, "two rounds of run 'long'", fleet.tail)
        assert all("device-3" not in r["clients"] for r in rows(fleet, "long")), rows(fleet, "long")
        # device-1 frozen mid-run, revoked, thawed: it says it was revoked, uploads nothing after, exits 4.
        frozen.send_signal(signal.SIGSTOP)
        server_cli("devices", "revoke", "device-1", "--fleet", str(fleet.state))
        frozen.send_signal(signal.SIGCONT)
        code = frozen.wait(120)
        text = (fleet.logs / "device-1.log").read_text()
        assert code == EXIT_REVOKED, (code, text[-3000:])
        assert "device-1: revoked: the broker refuses this device's credentials now" in text, text[-3000:]
        assert "error: device-1 was revoked" in text, text[-3000:]
        # Every round it says it uploaded, the broker acknowledged and the server took: the server holds at least as
        # many of its uploads as it has "uploaded" lines in run 'long' (a round finished while cut off, or handed to
        # a socket the broker had closed, is never said uploaded; on main it was, one more than the server got).
        # The claim, not the time, is checked: an upload acknowledged before the cut may be logged after the thaw,
        # and one the server got may lack its acknowledgement (the broker's close drops it: "never acknowledged").
        in_long = text[text.index("fleet 'default': run 'long'") :]
        claimed = sum("trained, uploaded" in x for x in in_long.splitlines())
        assert claimed >= 1, in_long[-3000:]
        wait_for(
            lambda: uploads_taken(fleet, "long", "device-1") >= claimed,
            30,
            f"the server to hold the {claimed} uploads device-1 said it made: {in_long[-2000:]}",
            fleet.tail,
        )
        long = (fleet.run_dir("long") / "server.log").read_text()
        assert "device device-1 revoked" in long and "device device-3 joined" not in long, long[-3000:]
    finally:
        fleet.stop()


@pytest.mark.mosquitto
@pytest.mark.skipif(LIBFAKETIME is None, reason="needs libfaketime (apt-get install faketime)")
def test_join_gives_up_at_its_connect_timeout_whatever_the_clock(tmp_path: Path) -> None:
    """Every clock of the process faked (its monotonic one too, faketime's default): a wait to a deadline on it never
    ended on main (join retried for ever, silently), whether the clock is a year ahead or stands still at 1970."""
    for clock in ("+365d", "1970-01-02 00:00:00"):
        cmd = [sys.executable, "-m", "edge_agent.cli", "join", "--broker", f"mqtt://127.0.0.1:{free_port()}"]
        cmd += ["--client-id", "d", "--data", "synthetic:n=50,size=12", "--connect-timeout", "3"]
        faked = {**env(), "LD_PRELOAD": str(LIBFAKETIME), "FAKETIME": clock}
        faked.pop("FAKETIME_DONT_FAKE_MONOTONIC", None)
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, env=faked, timeout=120)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"clock {clock}: join still retrying after 120 s (--connect-timeout 3)") from exc
        assert done.returncode == 2, (clock, done.stderr[-2000:])
        assert "cannot reach broker" in done.stderr, (clock, done.stderr[-2000:])
        assert os.environ.get("LD_PRELOAD") is None  # the faked clock was the child's alone
