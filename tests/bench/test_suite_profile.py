"""bench/suite_profile.py's summary: the workers' lines summed by file and test, the dearest (by CPU) first."""

from __future__ import annotations

from pathlib import Path

from bench.suite_profile import summarise


def test_the_summary_sums_by_file_and_orders_by_cpu(tmp_path: Path) -> None:
    (tmp_path / "tests.gw0.tsv").write_text("tests/a.py::t1\t10.00\t1.00\t2.00\ntests/b.py::t1\t5.00\t0.50\t9.50\n")
    (tmp_path / "tests.gw1.tsv").write_text("tests/a.py::t2\t4.00\t3.00\t0.00\n")
    lines = summarise(tmp_path, top=5).splitlines()
    assert lines[0] == (
        "3 tests: 19 s of worker wall time, 4 s of the workers' own CPU, 12 s of their reaped children's CPU"
    )
    files = [line for line in lines if line.startswith("| tests/") and "::" not in line]
    assert files == ["| tests/b.py | 5.0 | 0.5 | 9.5 |", "| tests/a.py | 14.0 | 4.0 | 2.0 |"]
    tests = [line.split(" | ")[0] for line in lines if "::" in line]
    assert tests == ["| tests/b.py::t1", "| tests/a.py::t1", "| tests/a.py::t2"]
    assert len(summarise(tmp_path, top=1).splitlines()) == 9  # the totals, then one file and one test


def test_the_summary_says_which_commands_went_the_ordinary_way_and_why(tmp_path: Path) -> None:
    (tmp_path / "tests.gw0.tsv").write_text("tests/a.py::t1\t1.00\t1.00\t1.00\n")
    (tmp_path / "refused.gw0.tsv").write_text("2\tdiffers from the launcher's: LD_PRELOAD\n")
    (tmp_path / "refused.gw1.tsv").write_text("3\tdiffers from the launcher's: LD_PRELOAD\n1\tPYTHONPATH /x\n")
    tail = summarise(tmp_path, top=5).splitlines()[-2:]
    assert tail == ["- 5 x differs from the launcher's: LD_PRELOAD", "- 1 x PYTHONPATH /x"]
