"""Watching a running `start` + 3 `join` federation (issue 26, "Done when"): `protofl-server status` (from
the state dir and, as the read-only monitor, from the broker), `/metrics` parsed with Prometheus' own text
parser, and the live page in headless Chromium all show the round and the 3 members; a device killed
shows offline in all of them within its grace period. Waits are polls with deadlines, never sleeps."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from broker_server.cli import app
from broker_server.ops.broker import free_port
from tests.broker_server.browser import chromium, eventually

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(REPO))
DATA = "synthetic:n=300,n_test=50"
GRACE = 30.0  # --offline-grace: a killed device must show offline everywhere well before it runs out
DEVICES = ("device-1", "device-2", "device-3")


@pytest.fixture
def browser() -> Iterator[object]:
    yield from chromium()


def status_text(*args: str) -> str:
    result = CliRunner().invoke(app, ["status", *args])
    assert result.exit_code == 0, result.output
    return result.output


def member_states(text: str) -> dict[str, str]:
    """device -> state, from the members table `status` prints."""
    return {m.group(1): m.group(2) for m in re.finditer(r"(device-\d)\s*│\s*([a-z]+)", text)}


def scrape(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """name -> {labels: value}, parsed by prometheus_client's text parser."""
    from prometheus_client.parser import text_string_to_metric_families

    body = urllib.request.urlopen(url, timeout=5).read().decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def page_states(driver: object) -> dict[str, str]:
    rows = driver.find_elements("css selector", "#devices tbody tr")  # type: ignore[attr-defined]
    return {r.get_attribute("data-device"): r.find_element("css selector", "td.state .pill").text for r in rows}


@pytest.mark.slow
@pytest.mark.mosquitto
def test_status_metrics_and_page_follow_a_federation(tmp_path: Path, browser: object) -> None:
    port, metrics_port, ui_port = free_port(), free_port(), free_port()
    state = tmp_path / "state"
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "broker_server.cli",
            "start",
            "--preset",
            "fedproto",
            "--fed",
            "watch",
            "--rounds",
            "1000",
            "--min-clients",
            "3",
            "--round-timeout",
            "300",
            "--port",
            str(port),
            "--state-dir",
            str(state),
            "--offline-grace",
            str(GRACE),
            "--metrics-port",
            str(metrics_port),
            "--ui-port",
            str(ui_port),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=ENV,
        text=True,
    )
    devices: dict[str, subprocess.Popen[bytes]] = {}
    try:
        creds = state / "security" / "devices"
        eventually(lambda: (creds / "device-3.json").exists() or server.poll() is not None, 60, "credentials")
        assert server.poll() is None, (tmp_path / "server.log").read_text()
        for i, dev in enumerate(DEVICES):
            devices[dev] = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "edge_agent.cli",
                    "join",
                    "--broker",
                    f"mqtt://127.0.0.1:{port}",
                    "--credentials",
                    str(creds / f"{dev}.json"),
                    "--data",
                    DATA,
                    "--partition",
                    f"{i}/3",
                    "--threads",
                    "1",
                    "--connect-timeout",
                    "60",
                    "--test-every",
                    "1",
                ],  # global acc in every row
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=ENV,
            )

        # status, from the state dir: the round and 3 members online
        def all_online() -> str | None:
            text = status_text("--state-dir", str(state))
            return text if re.search(r"running, round \d+/1000", text) and "(3 online)" in text else None

        text = eventually(all_online, 240, "status to show a running round with 3 members online")
        assert re.search(r"federation 'watch' \(fedproto\): running, round \d+/1000", text), text
        assert member_states(text) == dict.fromkeys(DEVICES, "online"), text

        # ... and from the broker, as the generated read-only monitor (its summary is at most a second behind)
        def monitor_all_online() -> str | None:
            text = status_text("--broker", f"mqtt://127.0.0.1:{port}", "--state-dir", str(state))
            return text if re.search(r"running, round \d+/1000", text) and "(3 online)" in text else None

        text = eventually(monitor_all_online, 30, "the monitor's status to show 3 members online")
        assert member_states(text) == dict.fromkeys(DEVICES, "online"), text

        # /metrics, through Prometheus' own parser
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        m = scrape(metrics_url)
        assert m["protofl_round"][()] >= 1 and m["protofl_rounds_planned"][()] == 1000
        assert {dict(k)["device"]: v for k, v in m["protofl_device_online"].items()} == dict.fromkeys(DEVICES, 1.0)
        assert m["protofl_members"][(("state", "online"),)] == 3
        assert m["protofl_phase"][(("phase", "train"),)] == 1
        assert m["protofl_federation_info"][(("fed", "watch"), ("preset", "fedproto"))] == 1
        assert m["protofl_journal_fsync_seconds_count"][()] > 0  # --state-dir: every accepted join was fsynced
        assert m["protofl_uplink_bytes_total"][()] > 0 and m["protofl_broker_restarts_total"][()] == 0

        # the live page, in a real browser
        browser.get(f"http://127.0.0.1:{ui_port}/")  # type: ignore[attr-defined]
        eventually(lambda: page_states(browser) == dict.fromkeys(DEVICES, "online"), 30, "the page's 3 devices online")
        round_text = browser.find_element("id", "round").text  # type: ignore[attr-defined]
        assert re.fullmatch(r"round \d+/1000", round_text), round_text
        eventually(
            lambda: browser.find_elements("css selector", "#accuracy polyline"),  # type: ignore[attr-defined]
            60,
            "an accuracy curve once a round's metrics are in",
        )

        # kill a device: offline in all three, within its grace
        devices["device-2"].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        offline = ("offline",)
        eventually(
            lambda: member_states(status_text("--state-dir", str(state))).get("device-2") in offline,
            GRACE,
            "status to show device-2 offline",
        )
        eventually(
            lambda: scrape(metrics_url)["protofl_device_online"][(("device", "device-2"),)] == 0,
            GRACE,
            "/metrics to show device-2 offline",
        )
        eventually(lambda: page_states(browser).get("device-2") in offline, GRACE, "the page to show device-2 offline")
        assert time.monotonic() - killed < GRACE
        assert member_states(status_text("--state-dir", str(state)))["device-1"] == "online"
        assert scrape(metrics_url)["protofl_members"][(("state", "offline"),)] == 1

        shot = tmp_path / "live-page.png"
        assert browser.save_screenshot(str(shot)) and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # type: ignore[attr-defined]
        if os.environ.get("PROTOFL_SCREENSHOTS"):
            shutil.copy(shot, Path(os.environ["PROTOFL_SCREENSHOTS"]) / "live-page.png")
    finally:
        procs: list[subprocess.Popen[Any]] = [*devices.values(), server]  # bytes and text pipes
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    log.close()
    out = (tmp_path / "server.log").read_text()
    assert "device device-2 went offline" in out, out[-3000:]
    summary = status_text("--state-dir", str(state))
    assert "federation 'watch' (fedproto): stopped" in summary, summary
    # rounds.jsonl: a line a round, once its metrics are in, with the accuracies
    rows = [json.loads(line) for line in (state / "rounds.jsonl").read_text().splitlines()]
    assert rows and rows[0]["round"] == 1 and rows[0]["preset"] == "fedproto"
    assert rows[0]["local_acc"] is not None and rows[0]["global_acc"] is not None, rows[0]
