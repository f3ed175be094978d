"""bench.gpu_sizing's summary: figures at the asked round, test-set figures from the last scored round, a
cut run shown at its last round, an empty run shown as such."""

from __future__ import annotations

import json
from pathlib import Path

from bench.gpu_sizing import summary


def _write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _row(rnd: int, local: float, up: int, **tested: float) -> dict:
    return {
        "round": rnd,
        "local_acc": local,
        "local_proto_acc": None,
        "local_own_proto_acc": None,
        "uplink_bytes": up,
        "wall_s": 10.0 * rnd,
        **tested,
    }


def test_summary_reads_the_asked_round_and_the_last_scored_one(tmp_path: Path) -> None:
    _write(
        tmp_path / "a0.5-fedproto-s0.rounds.jsonl",
        [_row(1, 0.5, 1_000_000), _row(2, 0.6, 1_000_000, global_acc=0.7, ensemble_acc=0.8), _row(3, 0.65, 1_000_000)],
    )
    _write(tmp_path / "a0.5-fedavg-s0.rounds.jsonl", [_row(1, 0.4, 5_000_000)])  # cut after round 1
    (tmp_path / "a0.5-tinyproto-s0.rounds.jsonl").write_text("")  # started, no round finished
    lines = summary(tmp_path, at=2).splitlines()
    by_run = {line.split(" | ")[0].strip("| "): line for line in lines[2:]}
    assert by_run["a0.5-fedproto-s0"] == (
        "| a0.5-fedproto-s0 | 3 | 30.0 | 2 | 60.00 | - | - | 70.00 | - | 80.00 | - | 2.0 |"
    )
    assert by_run["a0.5-fedavg-s0"] == "| a0.5-fedavg-s0 | 1 | 10.0 | 1 | 40.00 | - | - | - | - | - | - | 5.0 |"
    assert by_run["a0.5-tinyproto-s0"].startswith("| a0.5-tinyproto-s0 | 0 |")
    last = {line.split(" | ")[0].strip("| "): line for line in summary(tmp_path).splitlines()[2:]}
    assert "| 3 (test set: 2) | 65.00 |" in last["a0.5-fedproto-s0"]
    assert last["a0.5-fedproto-s0"].endswith("| 3.0 |")
