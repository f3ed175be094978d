"""Skipped bad files counted where operators look (issue 59, item 7): a device's loader skips its unreadable image
files; the device says how many in its metrics (`Metrics.extra["skipped_files"]`), and the server shows the count
in the member row of `protofl-server status` and as `protofl_device_skipped_files{device}` on --metrics-port. A
value no count can be is logged and ignored, changing nothing."""

from __future__ import annotations

import io
import json
import logging
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from broker_server.watch.observer import MAX_SKIPPED, skipped_files


@pytest.mark.slow
@pytest.mark.mosquitto
def test_status_counts_the_files_a_joined_device_skipped(tmp_path: Path) -> None:
    from PIL import Image

    from tests.broker_server.mqtt_helpers import start_and_join
    from tests.conftest import _require_mosquitto

    _require_mosquitto()
    rng = np.random.default_rng(0)
    imgs = tmp_path / "imgs"
    for k, name in enumerate(["ant", "bee", "cat"]):
        (imgs / name).mkdir(parents=True)
        for i in range(8):
            px = np.clip(k * 90 + rng.integers(-20, 20, (16, 16, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(px, "RGB").save(imgs / name / f"{i}.png")
    (imgs / "ant" / "torn.png").write_bytes(b"\x89PNG\r\n\x1a\n not the rest of a png")
    (imgs / "cat" / "empty.jpg").write_bytes(b"")
    code, dev_out, server_code, out = start_and_join(tmp_path, "skipped59", f"imagefolder:{imgs}")
    assert code == 0, dev_out
    assert server_code == 0, out
    assert "skipped 2:" in " ".join(dev_out.split()), dev_out

    state = str(tmp_path / "state")
    run = [sys.executable, "-m", "broker_server.cli", "status", "--state-dir", state]
    shown = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "skipped" in shown.stdout, shown.stdout
    row = next(line for line in shown.stdout.splitlines() if "cam-1" in line)
    assert re.search(r"│\s+1 │\s+2 │", row), shown.stdout  # uploads (1, on one round), then skipped: 2
    doc = json.loads(subprocess.run([*run, "--json"], capture_output=True, text=True, timeout=60).stdout)
    assert [m["skipped_files"] for m in doc["members"] if m["id"] == "cam-1"] == [2], doc["members"]


def test_a_count_no_device_can_hold_is_logged_and_ignored(caplog: pytest.LogCaptureFixture) -> None:
    assert skipped_files("dev", {}) is None
    assert skipped_files("dev", {"skipped_files": 0.0}) == 0
    assert skipped_files("dev", {"skipped_files": 3.0, "train_s": 1.5}) == 3
    assert skipped_files("dev", {"skipped_files": float(MAX_SKIPPED)}) == MAX_SKIPPED
    with caplog.at_level(logging.WARNING, logger="protofl.service"):
        for bad in (-1.0, 2.5, math.nan, math.inf, float(MAX_SKIPPED + 1), 1e300):
            caplog.clear()
            assert skipped_files("dev-h", {"skipped_files": bad}) is None, bad
            assert "device dev-h: its metrics' skipped_files" in caplog.text and "ignored" in caplog.text, bad


def test_the_member_row_and_the_gauge_show_the_count() -> None:
    from prometheus_client import generate_latest
    from prometheus_client.core import CollectorRegistry
    from rich.console import Console

    from broker_server.watch.board import SnapshotBoard
    from broker_server.watch.metrics import SnapshotCollector
    from broker_server.watch.render import members_table
    from broker_server.watch.snapshot import Member, Snapshot
    from tests.broker_server.test_watch_parts import snapshot

    snap = snapshot(members=(Member("dev-a", "online", skipped_files=7), Member("dev-b", "online")))
    assert Snapshot.decode(snap.encode()).members[0].skipped_files == 7
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(members_table(snap, snap.updated))
    table = console.export_text()
    assert "┃ uploads ┃ skipped ┃" in table, table
    assert re.search(r"│\s+0 │\s+7 │", next(line for line in table.splitlines() if "dev-a" in line)), table
    # no member skipped anything: no column
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(members_table(snapshot(), snap.updated))
    assert "skipped" not in console.export_text()

    board = SnapshotBoard()
    board.publish(snap)
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(board))
    text = generate_latest(registry).decode()
    assert 'protofl_device_skipped_files{device="dev-a"} 7.0' in text, text
    assert 'protofl_device_skipped_files{device="dev-b"} 0.0' in text, text
