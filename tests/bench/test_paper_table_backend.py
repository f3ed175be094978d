"""`bench.paper_table --backend ray`: every run's command gains the Ray options, nothing else changes."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import paper_table


def test_the_ray_options_reach_every_run_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert paper_table.main(["--suite", "quick", "--dry-run", "--results", str(tmp_path)]) == 0
    local = capsys.readouterr().out.splitlines()
    assert (
        paper_table.main(
            [
                "--suite",
                "quick",
                "--dry-run",
                "--results",
                str(tmp_path),
                "--backend",
                "ray",
                "--ray-address",
                "auto",
                "--device-resources",
                "cpu=2",
            ]
        )
        == 0
    )
    on_ray = capsys.readouterr().out.splitlines()
    assert len(on_ray) == len(local) > 0
    for a, b in zip(local, on_ray, strict=True):
        assert b == a + " --backend ray --ray-address auto --device-resources cpu=2"


def test_ray_options_without_the_ray_backend_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        paper_table.main(["--suite", "quick", "--dry-run", "--results", str(tmp_path), "--ray-address", "auto"])
    assert exc.value.code == 2
