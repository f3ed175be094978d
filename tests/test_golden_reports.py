"""Each preset on a fixed seed gives the report recorded before the round-plan refactor.

Bytes must match exactly and accuracies to 1e-6; keys the golden report lacks are allowed only when
they are the fields added since (nearest-prototype accuracy), and the only byte differences allowed
are the two `_intended_changes`, each exact. A change here is a change of behaviour.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

GOLDEN = Path(__file__).parent / "golden"
sys.path.insert(0, str(GOLDEN))
from record import CASES, FED  # noqa: E402

NEW_KEYS = {"local_proto_acc", "global_proto_acc", "device"}


def _intended_changes(want: dict[str, Any], got: dict[str, Any]) -> None:
    """Apply the two changes of behaviour the refactor made on purpose, exactly, to `want`.

    1. The dead config field `extra` ({}) is gone: every device receives the config once, at its
       join in round 1, and each copy is len(msgpack "extra") + len(msgpack {}) = 6 + 1 bytes shorter.
    2. Metrics carry the nearest-prototype counts: evaluation traffic (`metrics_bytes`, never
       counted as uplink) grows by their encoding; it may only grow.
    """
    import msgpack

    assert want["config"].pop("extra") == {}
    saved = (len(msgpack.packb("extra")) + len(msgpack.packb({}))) * want["simulation"]["clients"]
    want["rounds"][0]["downlink_bytes"] -= saved
    want["totals"]["downlink_bytes"] -= saved
    for w, g in zip(want["rounds"], got["rounds"]):
        assert g["metrics_bytes"] >= w["metrics_bytes"], (g["metrics_bytes"], w["metrics_bytes"])
        w["metrics_bytes"] = g["metrics_bytes"]


def _compare(path: str, want: Any, got: Any, problems: list[str]) -> None:
    if isinstance(want, dict):
        if not isinstance(got, dict):
            problems.append(f"{path}: expected a mapping, got {got!r}")
            return
        for key in want:
            if key not in got:
                problems.append(f"{path}.{key}: missing")
            else:
                _compare(f"{path}.{key}", want[key], got[key], problems)
        extra = set(got) - set(want) - NEW_KEYS
        if extra:
            problems.append(f"{path}: unexpected keys {sorted(extra)}")
    elif isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            problems.append(f"{path}: expected {want!r}, got {got!r}")
            return
        for i, (w, g) in enumerate(zip(want, got)):
            _compare(f"{path}[{i}]", w, g, problems)
    elif isinstance(want, float) and not isinstance(got, bool) and isinstance(got, (int, float)):
        if not math.isclose(want, got, rel_tol=0, abs_tol=1e-6):
            problems.append(f"{path}: expected {want}, got {got}")
    elif want != got or type(want) is not type(got):
        problems.append(f"{path}: expected {want!r}, got {got!r}")


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_report_matches_the_recorded_one(case: str, one_torch_thread: None) -> None:
    from broker_server.simulation import SimulationSpec, run_simulation

    spec = SimulationSpec(**{"preset": case, **FED, **CASES[case]})
    got = run_simulation(spec)
    got["totals"].pop("wall_s")
    want = json.loads((GOLDEN / f"{case}.json").read_text())
    got = json.loads(json.dumps(got))
    _intended_changes(want, got)
    problems: list[str] = []
    _compare(case, want, got, problems)
    assert not problems, "\n".join(problems[:20])
