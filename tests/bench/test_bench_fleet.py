"""bench/bench_fleet.py: a server of another tree (`--server-tree`) is that tree's code, wherever the benchmark runs
from (`python -m` puts the working directory before PYTHONPATH: run from ours, it had run our server)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from bench.bench_fleet import REPO, cli


def test_a_server_tree_runs_its_own_code_from_our_directory(tmp_path: Path) -> None:
    tree = tmp_path / "other"
    (tree / "broker_server").mkdir(parents=True)
    (tree / "broker_server" / "__init__.py").write_text("")
    (tree / "broker_server" / "cli.py").write_text("print('the other tree')\n")
    log = tmp_path / "server.log"
    assert Path(os.getcwd()).resolve() == REPO.resolve()  # pytest runs from the project's root, as the bench does
    proc = cli("broker_server.cli", "start", log=log, tree=tree, python=sys.executable)
    assert proc.wait(120) == 0, log.read_text()
    assert log.read_text().strip() == "the other tree", log.read_text()
