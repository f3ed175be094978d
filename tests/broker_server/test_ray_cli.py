"""`simulate --backend ray`'s options as a user meets them: a clear error (exit 2) before anything runs."""

from __future__ import annotations

import sys

import pytest
from typer.testing import CliRunner

from broker_server.cli import app

runner = CliRunner()
SMALL = ["simulate", "--dataset", "synthetic:n=200,n_test=50", "--clients", "2", "--rounds", "1", "-q"]


def test_without_ray_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, as where it is not installed
    out = tmp_path / "r.json"
    res = runner.invoke(app, [*SMALL, "--backend", "ray", "--json", str(out)])
    assert res.exit_code == 2, res.output
    assert "pip install 'protofl-edge[ray]'" in " ".join(res.output.split())
    assert not out.exists()


@pytest.mark.parametrize(
    "args, says",
    [
        (["--backend", "spark"], "--backend must be local or ray"),
        (["--backend", "ray", "--transport", "mqtt"], "leave out --transport mqtt"),
        (["--backend", "ray", "--device-resources", "cpu=1,tpu=2"], "'tpu=2' is not cpu=N or gpu=N"),
        (["--backend", "ray", "--device-resources", "cpu=-1"], "cpu must be a number >= 0"),
        (["--backend", "ray", "--device-resources", "cpu=0"], "needs some cpu or gpu"),
        (["--backend", "ray", "--ray-workers", "0"], "--ray-workers must be >= 1"),
        (["--backend", "ray", "--ray-max-restarts", "-1"], "--ray-max-restarts must be >= 0"),
    ],
)
def test_bad_ray_options_exit_2_with_a_reason(args: list[str], says: str) -> None:
    res = runner.invoke(app, [*SMALL, *args])
    assert res.exit_code == 2, res.output
    assert says in " ".join(res.output.split())
