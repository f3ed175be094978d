"""Each preset on a fixed seed gives the report recorded in tests/golden (see its README for when).

Bytes must match exactly and accuracies to 1e-6; keys the golden report lacks are not allowed. A
change here is a change of behaviour: re-record only when it is intended, and say so in the commit.
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
        extra = set(got) - set(want)
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
    got.pop("machine")  # the CPU model and thread counts the run had: not behaviour
    want = json.loads((GOLDEN / f"{case}.json").read_text())
    got = json.loads(json.dumps(got))
    problems: list[str] = []
    _compare(case, want, got, problems)
    assert not problems, "\n".join(problems[:20])
