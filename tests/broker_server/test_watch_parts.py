"""The parts of watching a federation (issue 26) on their own: the summary document, the live page's
password, the metrics before and after a snapshot, and what `status` says of a dead server."""

from __future__ import annotations

import base64
import json
import os
import time
import urllib.error
import urllib.request
from dataclasses import asdict
from pathlib import Path

import pytest
from typer.testing import CliRunner

from broker_server.cli import app
from broker_server.watch.board import SnapshotBoard
from broker_server.watch.metrics import FederationMetrics, serve_metrics
from broker_server.watch.snapshot import Member, RoundRow, Snapshot, SummaryError, Upload
from broker_server.watch.sources import read_state_dir
from broker_server.watch.ui import serve_ui, ui_password


def snapshot(**changes: object) -> Snapshot:
    """A running server's snapshot, updated now (a module-level time would be stale in a long suite run)."""
    now = time.time()
    base = dict(
        fed="lab",
        preset="tinyproto",
        state="running",
        round=3,
        rounds=10,
        updated=now,
        phase="train",
        deadline=now + 30,
        quorum=2,
        completed=2,
        server_pid=os.getpid(),
        started=900.0,
        members=(
            Member("dev-a", "online", "cnn", 600, "rpi4+lte", 2, Upload(2, "train", "protos", 2200, "f2", 990.0)),
            Member("dev-b", "offline", "cnn", 500, grace_ends=1004.0),
        ),
        uplink_bytes=9000,
        downlink_bytes=20000,
        accepted={"protos": 4},
        dropped={"duplicate": 1},
        history=(
            RoundRow(1, 2, "quorum", 900.0, 950.0, 4000, 10000, 0.5, 0.4, predictor_acc=0.75),
            RoundRow(2, 2, "quorum", 950.0, 990.0, 5000, 10000),
        ),
    )
    base.update(changes)
    return Snapshot(**base)  # type: ignore[arg-type]


def test_the_summary_round_trips_and_refuses_another_version() -> None:
    snap = snapshot()
    assert Snapshot.decode(snap.encode()) == snap
    # The field-by-field JSON form is exactly what dataclasses.asdict gives (it replaced it for speed).
    assert json.loads(snap.encode()) == json.loads(json.dumps({"v": 1, "kind": "protofl.summary", **asdict(snap)}))
    want = {"local_acc": 0.5, "global_acc": 0.4, "predictor_acc": 0.75}
    assert snap.last_accuracies() == (1, want)  # round 2's metrics not in
    raw = json.loads(snap.encode())
    raw["added_later"] = {"x": 1}  # a newer writer's field: ignored
    assert Snapshot.from_json(raw) == snap
    with pytest.raises(SummaryError, match="summary version 2; this build reads 1"):
        Snapshot.from_json({**raw, "v": 2})
    with pytest.raises(SummaryError, match="not a protofl summary"):
        Snapshot.decode(b'{"v": 1}')


def test_status_from_a_state_dir_and_what_it_says_of_a_dead_server(tmp_path: Path) -> None:
    (tmp_path / "status.json").write_bytes(snapshot().encode())
    result = CliRunner().invoke(app, ["status", "--state-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "federation 'lab' (tinyproto): running, round 3/10, phase train" in result.output
    assert "members: 2 (1 online, 1 offline); quorum 2" in result.output
    assert "accuracy (round 1): local (own classes) 50.0 %, global 40.0 %" in result.output
    assert "dropped: duplicate 1" in result.output
    gone = snapshot(server_pid=2**22 + 12345)  # beyond pid_max: no such process
    (tmp_path / "status.json").write_bytes(gone.encode())
    assert read_state_dir(tmp_path, now=gone.updated + 5).server.startswith("not running (process 4206649 is gone")
    alive = snapshot()
    (tmp_path / "status.json").write_bytes(alive.encode())
    assert read_state_dir(tmp_path, now=alive.updated + 60).server == "not responding (last update 60 s ago)"
    result = CliRunner().invoke(app, ["status", "--state-dir", str(tmp_path / "nope")])
    assert result.exit_code == 2 and "no such directory" in " ".join(result.output.split())
    result = CliRunner().invoke(app, ["status"])
    assert result.exit_code == 2 and "say where the federation is" in " ".join(result.output.split())


def test_the_live_page_asks_for_a_password_when_it_has_one(tmp_path: Path) -> None:
    assert ui_password(None, "127.0.0.1", True, tmp_path) is None  # loopback: open
    generated = ui_password(None, "0.0.0.0", False, tmp_path)
    assert generated and ui_password(None, "0.0.0.0", False, tmp_path) == generated  # kept across restarts
    assert oct((tmp_path / "ui-password").stat().st_mode & 0o777) == "0o600"
    board = SnapshotBoard()
    endpoint = serve_ui(board, "127.0.0.1", 0, "s3cret")
    try:
        url = endpoint.url + "api/summary"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(url, timeout=5)
        assert refused.value.code == 401

        def get(user: str, password: str) -> urllib.request.Request:
            token = base64.b64encode(f"{user}:{password}".encode()).decode()
            return urllib.request.Request(url, headers={"Authorization": f"Basic {token}"})

        with pytest.raises(urllib.error.HTTPError) as wrong:
            urllib.request.urlopen(get("protofl", "guess"), timeout=5)
        assert wrong.value.code == 401
        with pytest.raises(urllib.error.HTTPError) as starting:
            urllib.request.urlopen(get("protofl", "s3cret"), timeout=5)
        assert starting.value.code == 503  # no snapshot yet
        published = snapshot()
        board.publish(published)
        body = urllib.request.urlopen(get("protofl", "s3cret"), timeout=5).read()
        assert Snapshot.decode(body) == published
        page = (
            urllib.request.urlopen(
                urllib.request.Request(endpoint.url, headers=get("protofl", "s3cret").headers), timeout=5
            )
            .read()
            .decode()
        )
        assert "<title>protofl federation</title>" in page and "api/summary" in page
    finally:
        endpoint.close()


def test_metrics_follow_the_board() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    board = SnapshotBoard()
    metrics = FederationMetrics(board)
    endpoint = serve_metrics(metrics, "127.0.0.1", 0)
    try:

        def scrape() -> dict[str, float]:
            text = urllib.request.urlopen(endpoint.url, timeout=5).read().decode()
            return {
                s.name + json.dumps(s.labels, sort_keys=True): s.value
                for f in text_string_to_metric_families(text)
                for s in f.samples
            }

        assert not any(k.startswith("protofl_round{") for k in scrape())  # nothing before the first snapshot
        metrics.round_duration.observe(42.0)
        metrics.fsync.observe(0.003)
        board.publish(snapshot())
        got = scrape()
        assert got["protofl_round{}"] == 3 and got["protofl_rounds_completed_total{}"] == 2
        assert got['protofl_phase{"phase": "train"}'] == 1 and got['protofl_phase{"phase": "waiting"}'] == 0
        assert got['protofl_device_online{"device": "dev-a"}'] == 1
        assert got['protofl_device_online{"device": "dev-b"}'] == 0
        assert got['protofl_members{"state": "offline"}'] == 1
        assert got['protofl_uploads_dropped_total{"reason": "duplicate"}'] == 1
        assert got['protofl_uploads_accepted_total{"kind": "protos"}'] == 4
        assert got["protofl_uplink_bytes_total{}"] == 9000 and got["protofl_downlink_bytes_total{}"] == 20000
        assert got['protofl_accuracy_ratio{"kind": "local"}'] == 0.5 and got["protofl_accuracy_round{}"] == 1
        assert got["protofl_round_duration_seconds_count{}"] == 1
        assert got['protofl_round_duration_seconds_bucket{"le": "60.0"}'] == 1
        assert got['protofl_journal_fsync_seconds_bucket{"le": "0.005"}'] == 1
        assert got["protofl_broker_restarts_total{}"] == 0
    finally:
        endpoint.close()


def test_status_watch_refreshes_into_a_pipe(tmp_path: Path) -> None:
    (tmp_path / "status.json").write_bytes(snapshot().encode())
    result = CliRunner().invoke(
        app, ["status", "--state-dir", str(tmp_path), "--watch", "--interval", "0.05", "--updates", "3"]
    )
    assert result.exit_code == 0, result.output
    assert result.output.count("federation 'lab' (tinyproto): running, round 3/10") == 3, result.output
    (tmp_path / "status.json").unlink()  # the server's file gone for a moment: said, and tried again
    result = CliRunner().invoke(
        app, ["status", "--state-dir", str(tmp_path), "--watch", "--interval", "0.05", "--updates", "2", "--json"]
    )
    assert result.exit_code == 0 and result.output.count("cannot read the federation") == 2, result.output


def test_start_refuses_a_taken_watch_port_before_writing_anything(tmp_path: Path) -> None:
    import socket
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        for flag in ("--metrics-port", "--ui-port"):
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "broker_server.cli",
                    "start",
                    "--preset",
                    "fedproto",
                    "--port",
                    "0",
                    "--fed",
                    "w",
                    "--state-dir",
                    str(tmp_path / "state"),
                    flag,
                    str(taken.getsockname()[1]),
                ],
                capture_output=True,
                text=True,
                timeout=60,
                env=dict(os.environ, PYTHONPATH=str(repo), COLUMNS="250"),
            )
            assert out.returncode == 2, out.stderr
            assert f"{flag} {taken.getsockname()[1]} on 127.0.0.1" in out.stderr and "0 for any free one" in out.stderr
            assert not (tmp_path / "state" / "security").exists()
    finally:
        taken.close()


def test_a_costly_snapshot_is_refreshed_less_often(tmp_path: Path) -> None:
    # At a fleet's size a snapshot takes long to build: refreshing every REFRESH_S would take the thread that
    # folds the uploads (issue 27); a refresh waits at least COST_SHARE times its last cost.
    from broker_server.core.shell import Aggregator
    from broker_server.watch.live import COST_SHARE, REFRESH_S, LiveWatch
    from protofl.presets import make_config
    from protofl.transport import InProcessBroker

    agg = Aggregator(
        make_config("fedproto", rounds=1, num_classes=3, proto_dim=64), "w", InProcessBroker().connect("server")
    )
    watch = LiveWatch(agg, state_dir=tmp_path)
    watch.refresh(now=100.0)
    assert watch._cost > 0 and (tmp_path / "status.json").exists()
    watch._cost = 1.0  # as if the last snapshot took a second
    watch.after_step(1, now=100.0 + REFRESH_S)
    assert watch._built == 100.0  # not refreshed: due after COST_SHARE seconds
    watch.after_step(1, now=100.0 + COST_SHARE)
    assert watch._built == 100.0 + COST_SHARE
    watch._cost = 0.0  # a cheap one: every REFRESH_S again
    watch.after_step(1, now=100.0 + COST_SHARE + REFRESH_S)
    assert watch._built == 100.0 + COST_SHARE + REFRESH_S


# -- issue 41: say what each number is -----------------------------------------------------------------


def test_status_metrics_and_page_say_local_is_on_each_devices_own_classes(tmp_path: Path) -> None:
    # "local" accuracy (each device on its own held-out split) read as the federation's accuracy: every
    # place that shows it says it is on the device's own classes, while the machine-readable names stay.
    from prometheus_client import generate_latest
    from prometheus_client.core import CollectorRegistry

    from broker_server.watch.metrics import SnapshotCollector
    from broker_server.watch.snapshot import ACCURACY_KEYS
    from broker_server.watch.ui import page_html
    from protofl.humanize import accuracy_label, accuracy_legend

    (tmp_path / "status.json").write_bytes(snapshot().encode())
    result = CliRunner().invoke(app, ["status", "--state-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "accuracy (round 1): local (own classes) 50.0 %, global 40.0 %" in out, result.output
    assert "┃ local (own classes) % ┃ global % ┃ local proto (own classes) % ┃" in result.output, result.output
    # the rounds table's legend: local and global (the only ones reported), not proto
    legend = accuracy_legend(["local_acc", "global_acc"])
    assert legend in out and "not the federation's accuracy on every class" in legend, result.output
    assert "proto =" not in out, result.output
    doc = json.loads(CliRunner().invoke(app, ["status", "--state-dir", str(tmp_path), "--json"]).output)
    assert doc["history"][0]["local_acc"] == 0.5  # the JSON keeps its keys

    board = SnapshotBoard()
    board.publish(snapshot())
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(board))
    text = generate_latest(registry).decode()
    help_line = next(line for line in text.splitlines() if line.startswith("# HELP protofl_accuracy_ratio "))
    assert "on its own classes only, not the federation's accuracy on every class" in help_line, help_line
    assert 'protofl_accuracy_ratio{kind="local"} 0.5' in text  # label values unchanged
    assert 'protofl_accuracy_ratio{kind="predictor"} 0.75' in text  # the server's own score of the global predictor

    page = page_html().decode()
    for key in ACCURACY_KEYS:
        assert f'["{key}", "{accuracy_label(key)}", ' in page, key
    assert accuracy_legend(ACCURACY_KEYS) in page


def test_the_live_page_links_each_devices_log_and_serves_it_bounded_and_escaped(tmp_path: Path) -> None:
    import http.client

    from broker_server.ops.device_logs import FILE_CAP, DeviceLogs
    from broker_server.watch.ui import LOG_VIEW_BYTES
    from protofl import topics
    from protofl.wire import Status, encode_message

    logs = tmp_path / "device-logs"
    kept = DeviceLogs(logs, "lab")  # the server's own writer, fed what dev-a shipped
    said = Status(state="error", detail='<script>alert("x")</script> & more')
    kept.on_message(topics.device_log("lab", "dev-a"), encode_message(said, fed="lab", sender="dev-a"))
    # dev-b's log as long as the server keeps one (a full file and its rotated one): the page shows its newest part.
    lines = [f"2026-01-01 00:00:00 info line {i:06d} " + "y" * 60 + "\n" for i in range(2 * FILE_CAP // 80)]
    (logs / "dev-b.log.1").write_text("".join(lines[: len(lines) // 2]))
    (logs / "dev-b.log").write_text("".join(lines[len(lines) // 2 :]))
    (tmp_path / "secret.log").write_text("not a device's\n")
    board = SnapshotBoard()
    board.publish(snapshot())
    endpoint = serve_ui(board, "127.0.0.1", 0, "s3cret", logs)
    token = base64.b64encode(b"protofl:s3cret").decode()

    def get(path: str, auth: bool = True) -> tuple[int, str]:
        conn = http.client.HTTPConnection("127.0.0.1", endpoint.server.server_port, timeout=5)
        try:  # the path sent as written (urllib would normalise '..')
            conn.request("GET", path, headers={"Authorization": f"Basic {token}"} if auth else {})
            reply = conn.getresponse()
            return reply.status, reply.read().decode()
        finally:
            conn.close()

    try:
        code, page = get("/")
        assert code == 200 and 'href="logs/${esc(encodeURIComponent(m.id))}"' in page
        assert get("/logs/dev-a", auth=False)[0] == 401  # behind the page's password like the rest
        code, body = get("/logs/dev-a")
        assert code == 200 and "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; more" in body, body
        assert "<script" not in body and 'href="../"' in body
        code, body = get("/logs/dev-b")
        text = body[body.index("<pre>") + 5 : body.index("</pre>")]
        assert code == 200 and text.endswith(lines[-1]) and len(text) <= LOG_VIEW_BYTES, len(text)
        assert text.startswith("2026-01-01") and len(text) > LOG_VIEW_BYTES - 100  # whole lines, the newest
        code, body = get("/logs/dev-c")
        assert code == 200 and "no log lines from dev-c yet" in body
        for bad in ("/logs/../secret", "/logs/..%2Fsecret", "/logs/%2e%2e", "/logs/", "/logs/a/b", "/logs/x<y"):
            code, body = get(bad)
            assert code == 404 and "not a device's" not in body, (bad, code, body)
    finally:
        endpoint.close()
