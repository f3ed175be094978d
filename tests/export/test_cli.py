"""`protofl-export` through typer's CliRunner: exit codes, the figures on failure, clear input errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from export.cli import app
from tests.export.conftest import needs_fmnist

pytestmark = needs_fmnist
runner = CliRunner()


@pytest.fixture(scope="module")
def seeded_onnx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "cnn.onnx"
    r = runner.invoke(app, ["onnx", "--arch", "cnn", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "cnn features" in r.output and "(batch,512)" in r.output
    return out


def test_export_then_verify_passes(seeded_onnx: Path) -> None:
    r = runner.invoke(app, ["verify", str(seeded_onnx), "--arch", "cnn", "--n", "32"])
    assert r.exit_code == 0, r.output
    assert "PASS" in r.output and "checker ok" in r.output and "max |onnx - torch|" in r.output


def test_verify_with_other_weights_fails_with_the_figures(seeded_onnx: Path, trained_cnn: Path) -> None:
    r = runner.invoke(app, ["verify", str(seeded_onnx), "--checkpoint", str(trained_cnn), "--n", "32"])
    assert r.exit_code == 1, r.output
    assert "FAIL" in r.output and "max |onnx - torch| = " in r.output and "tolerance 0.0001" in r.output
    assert "does not hold these weights" in r.output


def test_verify_with_wrong_arch_fails(seeded_onnx: Path) -> None:
    r = runner.invoke(app, ["verify", str(seeded_onnx), "--arch", "mlp", "--n", "16"])
    assert r.exit_code == 1, r.output
    assert "exported from 'cnn' but compared with 'mlp'" in r.output
    assert "max |onnx - torch| = " in r.output


def test_missing_data_path_is_a_clear_error(seeded_onnx: Path, tmp_path: Path) -> None:
    r = runner.invoke(app, ["verify", str(seeded_onnx), "--data", f"npz:{tmp_path / 'nope.npz'}"])
    assert r.exit_code == 2
    assert "nope.npz does not exist" in r.output and "Traceback" not in r.output
    r = runner.invoke(app, ["verify", str(tmp_path / "absent.onnx"), "--arch", "cnn"])
    assert r.exit_code == 2 and "absent.onnx does not exist" in r.output
    (tmp_path / "junk.onnx").write_bytes(b"not a model")
    r = runner.invoke(app, ["verify", str(tmp_path / "junk.onnx")])
    assert r.exit_code == 2 and "junk.onnx is not an ONNX model" in r.output


def test_bad_options_exit_2(tmp_path: Path) -> None:
    r = runner.invoke(app, ["onnx", "--arch", "cnn", "--out", str(tmp_path / "m.onnx"), "--what", "head"])
    assert r.exit_code == 2 and "--what must be one of features, backbone" in r.output
    r = runner.invoke(app, ["onnx", "--arch", "vgg99", "--out", str(tmp_path / "m.onnx")])
    assert r.exit_code == 2 and "unknown architecture 'vgg99'" in r.output
    r = runner.invoke(
        app, ["onnx", "--arch", "cnn", "--checkpoint", str(tmp_path / "no.pt"), "--out", str(tmp_path / "x.onnx")]
    )
    assert r.exit_code == 2 and "no.pt does not exist" in r.output


def test_checkpoint_export_verifies_and_quantizes(trained_cnn: Path, tmp_path: Path) -> None:
    fp32, int8 = tmp_path / "t.onnx", tmp_path / "t8.onnx"
    r = runner.invoke(app, ["onnx", "--checkpoint", str(trained_cnn), "--out", str(fp32), "--exporter", "torchscript"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["verify", str(fp32), "--checkpoint", str(trained_cnn), "--n", "32"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(
        app,
        [
            "quantize",
            str(fp32),
            "--out",
            str(int8),
            "--mode",
            "static",
            "--calib",
            "128",
            "--train-n",
            "1000",
            "--test-n",
            "500",
            "--checkpoint",
            str(trained_cnn),
        ],
    )
    assert r.exit_code == 0, r.output
    assert "nearest-prototype accuracy fp32" in r.output and "int8 (static)" in r.output
    # what that accuracy measures (issue 41): the model, the images, the classes, the classifier
    assert "accuracy of t.onnx on 500 images of the test split of 'fashion-mnist' (10 of 10 classes), by nearest " in (
        r.output
    ), r.output
    assert "the class means of 1000 training images" in r.output, r.output
    assert "torch fp32 nearest-prototype accuracy" in r.output and int8.is_file()


def test_bench_prints_all_backends(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    r = runner.invoke(
        app, ["bench", "--arch", "mlp", "--batch", "1,8", "--iters", "2", "--int8-mode", "dynamic", "--json", str(out)]
    )
    assert r.exit_code == 0, r.output
    rows = json.loads(out.read_text())
    assert {(row["backend"], row["batch"]) for row in rows} == {
        (b, n) for b in ("torch", "onnx-fp32", "onnx-int8") for n in (1, 8)
    }
    assert all(row["latency_ms"] > 0 and row["threads"] == 1 for row in rows)
    r = runner.invoke(app, ["bench", "--arch", "mlp", "--profile", "no-such-device"])
    assert r.exit_code == 2 and "profile 'no-such-device' not found" in r.output


def test_version() -> None:
    r = runner.invoke(app, ["version"])
    assert r.exit_code == 0 and r.output.startswith("protofl-export ")
