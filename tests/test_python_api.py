"""The docs' Python API example (docs/how-to/own-model.md) runs as written (own data and own backbone in the script)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_docs_python_example_runs(tmp_path: Path) -> None:
    page = (REPO / "docs" / "how-to" / "own-model.md").read_text()
    block = re.search(r"```python\n(# my_trial\.py.+?)```", page, re.S)
    assert block is not None, "docs/how-to/own-model.md lost its Python API example"
    script = tmp_path / "my_trial.py"
    script.write_text(block.group(1))
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    got = re.search(r"local accuracy \(own classes\) ([\d.]+) %, uplink (\d+) B", proc.stdout)
    assert got is not None, proc.stdout[-2000:]
    assert float(got.group(1)) > 25.0 and int(got.group(2)) > 0  # 4 classes: better than chance


def test_join_refuses_an_unknown_option() -> None:
    from edge_agent.api import join
    from protofl.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown option"):
        join("synthetic", client_id="dev-1", learning_rate=0.1)
