"""Each preset on a fixed seed gives the report recorded in tests/golden (see its README for when).

Bytes (and every other integer, string and switch) must match exactly, accuracies to 1e-6 (they are counts
over a fixed test set: a 1e-6 change is a changed prediction), and every other float -- a measurement of
float32 features such as `off_mask_energy` -- to a relative 1e-4: what float32 arithmetic keeps across CPUs
and BLAS builds. The same wheel of torch and numpy computes the features with other kernels on another CPU
(oneDNN's and OpenBLAS's by instruction set), each op rounding at float32's 6e-8; through two rounds of
training and a mean over the test set that was measured at 1.8e-6 relative (an AMD EPYC box with numpy 2.4.6
and scipy-openblas 0.3.31 against the recording's Intel box), so 1e-4 leaves 50x headroom and still fails on
any change of behaviour (one changed training step moves these by 1e-3 or more). Keys the golden report lacks
are not allowed. A change here is a change of behaviour: re-record only when it is intended, and say so in
the commit.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.golden.record import CASES, FED

GOLDEN = Path(__file__).parent / "golden"

ACCURACY_ABS = 1e-6
MEASURE_REL = 1e-4
# The ridge predictor's accuracy (issue 41) sits on a backbone trained for 60 epochs (240 SGD steps) on the public
# set before the federation starts: far more steps than two rounds of local training, so float32's differences
# between CPUs grow further there, and an image whose two best classes are within them may change its label. Two of
# the 300 test images (0.0067) are allowed; a changed recipe (epochs, lambda, the statistics) moves it more, and the
# bytes and every other figure of the case still match exactly.
PREDICTOR_ABS = 2 / 300


def _close(path: str, want: float, got: float) -> bool:
    key = path.rsplit(".", 1)[-1].split("[", 1)[0]
    if key == "predictor_acc":
        return math.isclose(want, got, rel_tol=0, abs_tol=PREDICTOR_ABS + 1e-9)
    if key.endswith("_acc"):
        return math.isclose(want, got, rel_tol=0, abs_tol=ACCURACY_ABS)
    return math.isclose(want, got, rel_tol=MEASURE_REL, abs_tol=1e-12)


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
    # the cross-machine difference that failed the old 1e-6 (issue 40) passes; a changed prediction does not
    problems: list[str] = []
    _compare("r", {"off_mask_energy": 0.898313670}, {"off_mask_energy": 0.898312091}, problems)
    assert not problems
    _compare("r", {"off_mask_energy": 0.898313670}, {"off_mask_energy": 0.8975}, problems)
    _compare("r", {"rounds": [{"global_acc": 0.5}]}, {"rounds": [{"global_acc": 0.5 + 1 / 400}]}, problems)
    _compare("r", {"uplink_bytes": 100}, {"uplink_bytes": 101}, problems)
    assert len(problems) == 3, problems
