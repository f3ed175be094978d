"""The watch does not forget (issue 42): a real `protofl-server start` (its own broker) and 3 `protofl-edge join`
processes, the server killed with SIGKILL mid-federation and restarted, then `start` run once more on the finished
state dir. `status` (text and status.json) counts every upload the journal holds, per device too, and keeps every
round's accuracies as rounds.jsonl has them, after the restart and after the re-run; the re-run says nothing of
devices going offline for a federation that is over. Beside it, on the same run: each device's log names each
upload's bytes as the server counts them (status shows the same figure), and `protofl-export onnx --from` a device's
`join --state-dir` folder finds its artifact."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from broker_server.cli import app
from broker_server.core.durable import journal_records
from broker_server.ops.broker import free_port
from broker_server.watch.snapshot import ACCURACY_KEYS, Snapshot
from tests.broker_server.crash_helpers import REPO, Federation, env

CLIENTS, ROUNDS = 3, 4
UPLOAD_KINDS = ("adapter", "protos")


def rounds_logged(fed: Federation) -> list[dict[str, object]]:
    path = fed.state / "rounds.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line being written
    return out


def wait_for(pred: object, timeout: float, what: str, fed: Federation) -> None:
    end = time.monotonic() + timeout
    while not pred():  # type: ignore[operator]
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}; server log:\n{fed.log_tail()}")
        time.sleep(0.05)


def check_remembers(run: Run, status_file: Path) -> None:
    """`status_file` (status.json) and `status` count what the journal holds, and keep rounds.jsonl's accuracies."""
    snap = Snapshot.decode(status_file.read_bytes())
    total = sum(run.uploads.values())
    assert sum(snap.accepted.values()) == total, (snap.accepted, run.uploads)
    assert {m.id: m.uploads for m in snap.members} == dict(run.uploads)
    rows = {int(r["round"]): r for r in rounds_logged(run.fed)}  # type: ignore[call-overload]
    assert sorted(rows) == list(range(1, ROUNDS + 1))
    assert [h.round for h in snap.history] == list(range(1, ROUNDS + 1))
    for h in snap.history:
        want = {k: rows[h.round].get(k) for k in ACCURACY_KEYS}
        assert {k: getattr(h, k) for k in ACCURACY_KEYS} == want, h.round
        # The one round that may lack them: closed before the kill, its metrics not yet in (they died with the
        # process; the restarted server logs the round without them, start_cli.py says so).
        if h.round != run.logged_at_kill + 1:
            assert h.local_acc is not None, f"round {h.round} has no accuracy in rounds.jsonl to compare with"
    state = status_file.parent
    text = CliRunner().invoke(app, ["status", "--state-dir", str(state)]).output
    assert f"uploads accepted {total};" in text, text
    assert f"accuracy (round {ROUNDS})" in text, text


@dataclass
class Run:
    fed: Federation
    devices: list[Path]  # each device's `join --state-dir`
    uploads: Counter[str]  # the journal's uploads, by device
    restarted: Path  # a copy of the state dir's status.json once the restarted server finished
    rerun_log: str  # what `start` on the finished state dir logged
    logged_at_kill: int  # rounds.jsonl's lines when the server was killed


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """The federation, killed once two rounds are logged with their accuracies and restarted at once; then `start`
    once more on its finished state dir."""
    tmp = tmp_path_factory.mktemp("remember")
    fed = Federation("remember", CLIENTS, ROUNDS, tmp / "state", tmp / "logs", port=free_port())
    devices = [tmp / f"device-{i}" for i in range(CLIENTS)]
    fed.start_server()
    try:
        for i, folder in enumerate(devices):
            fed.device_state = folder
            fed.agents.append(fed.start_agent(i))
        wait_for(lambda: len(rounds_logged(fed)) >= 2, 240, "two rounds logged", fed)
        fed.kill_server()
        logged_at_kill = len(rounds_logged(fed))
        fed.start_server()
        fed.wait_finished(300)
    finally:
        fed.stop()
    log = (fed.logs / "server.log").read_text()
    assert log.count("resumed federation 'remember'") == 1, fed.log_tail()
    journal = journal_records(fed.state / "aggregator")
    uploads = Counter(r.client for r in journal if r.kind in UPLOAD_KINDS)
    assert uploads == dict.fromkeys((fed.client_id(i) for i in range(CLIENTS)), ROUNDS * len(UPLOAD_KINDS))
    restarted = tmp / "restarted" / "status.json"
    restarted.parent.mkdir()
    shutil.copy(fed.state / "status.json", restarted)
    shutil.copy(fed.state / "rounds.jsonl", restarted.parent / "rounds.jsonl")
    fed.start_server()
    try:
        assert fed.server is not None and fed.server.wait(120) == 0, fed.log_tail()
    finally:
        fed.stop()
    yield Run(fed, devices, uploads, restarted, (fed.logs / "server.log").read_text()[len(log) :], logged_at_kill)


@pytest.mark.slow
@pytest.mark.mosquitto
def test_status_keeps_counts_and_accuracies_across_a_kill(run: Run) -> None:
    check_remembers(run, run.restarted)


@pytest.mark.slow
@pytest.mark.mosquitto
def test_start_on_a_finished_state_dir_forgets_nothing_and_reports_no_departures(run: Run) -> None:
    assert "finished already" in run.rerun_log, run.rerun_log
    assert "went offline" not in run.rerun_log and " joined (" not in run.rerun_log, run.rerun_log
    check_remembers(run, run.fed.state / "status.json")


@pytest.mark.slow
@pytest.mark.mosquitto
def test_the_device_log_and_status_give_each_upload_the_same_bytes(run: Run) -> None:
    snap = Snapshot.decode((run.fed.state / "status.json").read_bytes())
    for m in snap.members:
        assert m.last_upload is not None and m.last_upload.round == ROUNDS, m
        said = re.findall(r"uploaded (\d+) bytes \(([^)]*)\)", (run.fed.logs / f"{m.id}.log").read_text())
        assert said, f"{m.id} logged no upload by kind"
        total, parts = said[-1]
        figures = {k: int(n) for k, n in re.findall(r"(\w+) (\d+) B", parts)}
        assert sum(figures.values()) == int(total)
        assert figures[m.last_upload.kind] == m.last_upload.bytes, (figures, m.last_upload)


@pytest.mark.slow
@pytest.mark.mosquitto
def test_export_from_a_devices_join_state_dir(run: Run, tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "export.cli", "onnx", "--from", str(run.devices[0]), "--out", str(tmp_path / "d.onnx")],
        capture_output=True,
        text=True,
        env=env(),
        cwd=REPO,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "d.onnx").stat().st_size > 0
