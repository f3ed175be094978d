"""Each preset on a fixed seed gives the report recorded in tests/golden (see its README for when).

Bytes (and every other integer, string and switch) must match exactly. Floats come from float32 training, whose
kernels differ by CPU (the same wheels of torch and numpy pick oneDNN's, MKL's and OpenBLAS's code by instruction
set, each op rounding at float32's 6e-8), and training amplifies those differences round after round: an image
whose two best classes are that close changes its label. Measured (2026-12-07) on an Intel Xeon with AVX-512
against the recorded reports (made on another x86 box), with torch's kernels at their default, at AVX2 and without
vector code (`ATEN_CPU_CAPABILITY`), all seven cases: every byte count identical; after round 1 (~20 SGD steps)
accuracies within 0.004 (1 of 249 held-out images) and measures such as `off_mask_energy` within 3.5e-5
relative; after round 2 (~40 steps, and the ridge predictor's 240-step backbone) accuracies within 0.020 (5 of
249) and measures within 2.1e-3. The tolerances below give those 2.5-3x headroom: round 1 to 0.012 and 1e-4, later
rounds to 0.05 and 5e-3. What still fails: any byte, count or switch; a changed round 1 (one changed step moves its
figures more than 1e-4); a later round off by more than 5 points. Keys the golden report lacks are not allowed. A
change here is a change of behaviour: re-record only when it is intended, and say so in the commit.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.golden.record import CASES, FED

GOLDEN = Path(__file__).parent / "golden"

# (accuracy, absolute; other floats, relative) in the first round, and after it
FIRST_ROUND = (0.012, 1e-4)
LATER = (0.05, 5e-3)


def _close(path: str, want: float, got: float) -> bool:
    key = path.rsplit(".", 1)[-1].split("[", 1)[0]
    accuracy, relative = FIRST_ROUND if ".rounds[0]." in path else LATER
    if key.endswith("_acc"):
        return math.isclose(want, got, rel_tol=0, abs_tol=accuracy + 1e-9)
    return math.isclose(want, got, rel_tol=relative, abs_tol=1e-12)


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
        for i, (w, g) in enumerate(zip(want, got, strict=True)):
            _compare(f"{path}[{i}]", w, g, problems)
    elif isinstance(want, float) and not isinstance(got, bool) and isinstance(got, (int, float)):
        if not _close(path, want, got):
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


def test_the_tolerances_keep_what_float32_keeps_and_catch_a_change() -> None:
    # the largest differences measured between CPUs pass (the module's docstring); a changed figure does not
    problems: list[str] = []
    first = {"rounds": [{"local_acc": 0.5421686746987951, "off_mask_energy": 0.6677575716274683}]}
    _compare("r", first, {"rounds": [{"local_acc": 0.5461847389558233, "off_mask_energy": 0.66778}]}, problems)
    later = {"rounds": [{}, {"local_acc": 0.6626506024096386, "off_mask_energy": 0.7221524652010745}]}
    _compare("r", later, {"rounds": [{}, {"local_acc": 0.642570281124498, "off_mask_energy": 0.72067}]}, problems)
    assert not problems
    _compare(
        "r", first, {"rounds": [{"local_acc": 0.5421686746987951 + 4 / 249, "off_mask_energy": 0.6677575716}]}, problems
    )
    _compare("r", first, {"rounds": [{"local_acc": 0.5421686746987951, "off_mask_energy": 0.6685}]}, problems)
    _compare("r", later, {"rounds": [{}, {"local_acc": 0.72, "off_mask_energy": 0.7221524652010745}]}, problems)
    _compare("r", later, {"rounds": [{}, {"local_acc": 0.6626506024096386, "off_mask_energy": 0.73}]}, problems)
    _compare("r", {"uplink_bytes": 100}, {"uplink_bytes": 101}, problems)
    assert len(problems) == 5, problems
