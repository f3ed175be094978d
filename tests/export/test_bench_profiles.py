"""`protofl-export bench --profile NAME` with every shipped device profile: each carries its `threads`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from edge_agent.inference.onnx_export import export_onnx
from edge_agent.training.models import build_model
from export.cli import app
from export.quantize import quantize_model
from protofl.profiles import DeviceProfile, known_profiles, load_profile

runner = CliRunner()
DEVICES = sorted(name for name, path in known_profiles().items() if isinstance(load_profile(str(path)), DeviceProfile))


def test_every_shipped_device_profile_states_its_threads() -> None:
    assert {"rpi3", "rpi4", "rpi5", "jetson-nano", "jetson-orin-nano", "x86-cpu", "x86-gpu"} <= set(DEVICES)
    for name in DEVICES:
        threads = load_profile(name).threads  # type: ignore[union-attr]
        assert isinstance(threads, int) and threads >= 1, name


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A small fp32 model and its int8 version, made once: the runs below time them, nothing more."""
    tmp = tmp_path_factory.mktemp("bench")
    fp32 = export_onnx(build_model("mlp", (1, 28, 28), 10, seed=0), tmp / "m.onnx", exporter="torchscript").path
    return fp32, quantize_model(fp32, tmp / "m8.onnx", "dynamic")


@pytest.mark.parametrize("profile", DEVICES)
def test_bench_runs_with_each_shipped_device_profile(profile: str, models: tuple[Path, Path], tmp_path: Path) -> None:
    fp32, int8 = models
    out = tmp_path / "rows.json"
    r = runner.invoke(
        app,
        [
            "bench",
            "--arch",
            "mlp",
            "--profile",
            profile,
            "--model",
            str(fp32),
            "--int8",
            str(int8),
            "--batch",
            "1",
            "--iters",
            "1",
            "--data",
            "synthetic:n=300",
            "--json",
            str(out),
        ],
    )
    assert r.exit_code == 0, r.output
    threads = load_profile(profile).threads  # type: ignore[union-attr]
    assert {row["threads"] for row in json.loads(out.read_text())} == {threads}


def test_a_profile_without_threads_or_a_link_says_what_to_do(tmp_path: Path) -> None:
    mine = tmp_path / "mine.toml"
    mine.write_text('kind = "device"\ncompute_factor = 1\nmemory_mb = 512\n')
    r = runner.invoke(app, ["bench", "--arch", "mlp", "--profile", str(mine)])
    assert r.exit_code == 2 and "sets no `threads`; add `threads = N`" in r.output
    r = runner.invoke(app, ["bench", "--arch", "mlp", "--profile", "lte"])
    assert r.exit_code == 2 and "names no device" in r.output
