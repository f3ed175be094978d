"""`protofl-edge doctor` and devices with wrong clocks (issue 45), against a real fleet serving TLS with its generated
CA: doctor names a wrong clock, an unreachable port, a wrong CA, a missing data path and a missing torch; a device
whose clock is at 1970 is told exactly why it cannot join, one a year ahead joins.

The clocks come from faketime (Debian's `faketime`) with FAKETIME_DONT_FAKE_MONOTONIC=1: a device whose wall clock
is wrong still has a steady monotonic clock (a Pi without RTC counts it from boot)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import date
from pathlib import Path

import pytest

from broker_server.ops.broker import free_port
from tests.broker_server.crash_helpers import env
from tests.broker_server.fleet_helpers import Fleet
from tests.conftest import EVENT_WAIT_S

LIBFAKETIME = next(iter(sorted(Path("/usr/lib").glob("*/faketime/libfaketime.so.1"))), None)
pytestmark = [
    pytest.mark.mosquitto,
    pytest.mark.skipif(LIBFAKETIME is None, reason="needs libfaketime (apt-get install faketime)"),
]


def clock_env(clock: str) -> dict[str, str]:
    """The environment of a process whose wall clock is `clock` (faketime's: '@1970-01-02 00:00:00' starts there
    and runs on, '+365d' is a year ahead); its monotonic clock stays true, as a real device's does."""
    return {"LD_PRELOAD": str(LIBFAKETIME), "FAKETIME": clock, "FAKETIME_DONT_FAKE_MONOTONIC": "1"}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("tls-fleet"), free_port(), 2, extra=["--tls", "on"])
    f.url = f"mqtts://127.0.0.1:{f.port}"
    try:
        f.start()
        yield f
    finally:
        f.stop()


def edge(
    *args: str, clock: str | None = None, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "edge_agent.cli", *args]
    e = {**env(**(extra_env or {})), **(clock_env(clock) if clock is not None else {})}
    return subprocess.run(cmd, capture_output=True, text=True, env=e, timeout=120)


def lines(done: subprocess.CompletedProcess[str]) -> dict[str, str]:
    """doctor's lines by check: 'STATUS detail'."""
    out = {}
    for line in done.stdout.splitlines():
        status, check, detail = line.split(None, 2)
        out[check] = f"{status} {detail}"
    return out


def test_doctor_says_all_is_well_then_names_each_fault(fleet: Fleet, tmp_path: Path) -> None:
    cred = str(fleet.credentials("device-1"))
    ok = edge("doctor", "--credentials", cred, "--broker", fleet.url, "--data", "synthetic")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    got = lines(ok)
    for check in ("credentials", "clock", "dns", "port", "tls", "login", "data", "torch"):
        assert got[check].startswith("OK"), ok.stdout

    late = lines(edge("doctor", "--credentials", cred, "--broker", fleet.url, clock="@1970-01-02 00:00:00"))
    assert late["clock"].startswith("FAIL this device's clock says 1970-01-02"), late
    assert "timedatectl set-ntp true" in late["clock"]

    down = edge("doctor", "--credentials", cred, "--broker", f"mqtts://127.0.0.1:{free_port()}")
    assert down.returncode == 1 and lines(down)["port"].startswith("FAIL 127.0.0.1:"), down.stdout

    other = tmp_path / "other.json"  # the same credentials with another fleet's CA
    from broker_server.ops.pki import ensure_federation_tls

    raw = json.loads(Path(cred).read_text())
    raw["ca"] = ensure_federation_tls(tmp_path / "tls", "other", ["127.0.0.1"]).ca_pem()
    other.write_text(json.dumps(raw))
    wrong = lines(edge("doctor", "--credentials", str(other), "--broker", fleet.url))
    assert wrong["tls"].startswith("FAIL") and "did not sign" in wrong["tls"], wrong

    nodata = lines(edge("doctor", "--data", f"npz:{tmp_path / 'missing.npz'}"))
    assert nodata["data"].startswith("FAIL") and "missing.npz" in nodata["data"], nodata

    hidden = tmp_path / "hide" / "torch"  # a torch that cannot be imported, first on the path
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('torch hidden by the test')\n")
    path = os.pathsep.join([str(tmp_path / "hide"), env()["PYTHONPATH"]])
    notorch = lines(edge("doctor", extra_env={"PYTHONPATH": path}))  # onnxruntime there: a lite device (issue 57)
    assert notorch["torch"].startswith("WARN not installed: join runs as a lite device"), notorch
    hidden = tmp_path / "hide" / "onnxruntime"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('onnxruntime hidden by the test')\n")
    neither = lines(edge("doctor", extra_env={"PYTHONPATH": path}))
    assert neither["torch"].startswith("FAIL neither torch nor onnxruntime can be imported"), neither


def test_a_device_at_1970_is_told_why_and_one_a_year_ahead_joins(fleet: Fleet) -> None:
    cred = str(fleet.credentials("device-2"))
    join = ["join", "--credentials", cred, "--broker", fleet.url, "--data", "synthetic:n=200,size=12"]
    early = edge(*join, "--connect-timeout", "5", clock="@1970-01-02 00:00:00")
    assert early.returncode == 2, early.stderr[-2000:]
    assert "certificate is not yet valid" in early.stderr and "this device's clock says 1970-01-02" in early.stderr
    assert "set the clock" in early.stderr, early.stderr[-2000:]

    fleet.submit("clock", "--preset", "tinyproto", "--rounds", "1", "--min-clients", "1", "--set", 'archs=["mlp"]')
    ahead = subprocess.Popen(
        [sys.executable, "-m", "edge_agent.cli", *join, "--partition", "0/1", "--threads", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**env(), **clock_env("+365d")},
    )
    try:
        fleet.wait_state("clock", "finished", 120)
        rows = (fleet.run_dir("clock") / "rounds.jsonl").read_text()
        assert "device-2" in rows, rows
    finally:
        ahead.terminate()
        out = ahead.communicate(timeout=EVENT_WAIT_S)[0].decode()
    assert "run 'clock' finished" in out and f"{date.today().year + 1}-" in out, out[-3000:]


def test_doctor_holds_the_clock_to_the_servers_status_and_the_runs_model_to_free_memory(fleet: Fleet) -> None:
    """While a run is served (waiting for devices), doctor reads its retained status and config: the server's time
    (a device 3 minutes behind, still within the certificates' validity, is told so) and the run's model."""
    from tests.broker_server.fleet_helpers import server_cli, wait_for

    fleet.submit(
        "doctor", "--preset", "tinyproto", "--rounds", "1", "--min-clients", "2", "--set", 'archs=["mobilenetv2"]'
    )
    log = fleet.run_dir("doctor") / "server.log"
    try:
        wait_for(lambda: log.exists() and "waiting for 2 client(s)" in log.read_text(), 120, "the run", fleet.tail)
        cred = str(fleet.credentials("device-1"))
        ok = lines(edge("doctor", "--credentials", cred, "--broker", fleet.url))
        assert ok["server-time"].startswith("OK not behind the server's"), ok
        assert "mobilenetv2 peaked at 808 MB" in ok["model"] and "MB available here" in ok["model"], ok
        behind = lines(edge("doctor", "--credentials", cred, "--broker", fleet.url, clock="-3m"))
        assert behind["clock"].startswith("OK"), behind  # the certificates cannot tell: 5 minutes of slack
        assert behind["server-time"].startswith("FAIL this device's clock"), behind
        assert "min behind the server's" in behind["server-time"] and "timedatectl" in behind["server-time"], behind
    finally:
        server_cli("run", "stop", "doctor", "--fleet", str(fleet.state))
        fleet.wait_state("doctor", "stopped", 60)


def test_doctor_says_what_to_do_about_a_model_too_big_and_an_older_server() -> None:
    from edge_agent.ops.doctor import model_findings, server_clock_findings
    from protofl.wire import Config, Status, encode_message

    config = encode_message(Config(preset="tinyproto", params={"archs": ["mlp", "mobilenetv2"]}), fed="f", sender="s")
    (short,) = model_findings(config, 500)
    assert short.status == "fail" and "mobilenetv2 peaked at 808 MB" in short.detail and "500 MB" in short.detail
    assert "smaller --arch" in short.fix
    (unknown,) = model_findings(
        encode_message(Config("tinyproto", {"archs": ["my.nets:make"]}), fed="f", sender="s"), 9
    )
    assert unknown.status == "warn" and "bench_footprint" in unknown.fix
    from datetime import datetime, timezone

    old = encode_message(Status(state="waiting", detail="0/2 clients"), fed="f", sender="s")
    (said,) = server_clock_findings(old, datetime.now(timezone.utc))
    assert said.status == "warn" and "older server" in said.detail
