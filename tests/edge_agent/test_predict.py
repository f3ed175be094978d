"""`protofl-edge predict`: nearest-prototype classification on onnxruntime, and its input errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from edge_agent.cli import app
from edge_agent.inference.onnx_export import export_onnx
from edge_agent.inference.predict import load_prototypes, save_prototypes
from edge_agent.training.models import build_model
from protofl.data import FASHION_MNIST_DIR
from protofl.errors import DataError

runner = CliRunner()


def test_prototype_table_round_trip(tmp_path: Path) -> None:
    protos = {3: np.ones(4, np.float32), 0: np.arange(4, dtype=np.float32)}
    path = save_prototypes(tmp_path / "p.npz", protos)
    back = load_prototypes(path)
    assert sorted(back) == [0, 3] and np.array_equal(back[0], protos[0])
    np.savez(tmp_path / "bad.npz", classes=np.arange(2), values=np.zeros((2, 4)))
    with pytest.raises(DataError, match="needs arrays 'classes'"):
        load_prototypes(tmp_path / "bad.npz")


@pytest.mark.skipif(not Path(FASHION_MNIST_DIR).is_dir(), reason=f"Fashion-MNIST not installed at {FASHION_MNIST_DIR}")
def test_predict_fits_then_classifies(tmp_path: Path) -> None:
    model = tmp_path / "f.onnx"
    export_onnx(build_model("mlp", (1, 28, 28), 10, seed=0), model, mean=(0.286,), std=(0.353,))
    protos, preds = tmp_path / "protos.npz", tmp_path / "pred.csv"
    r = runner.invoke(
        app,
        [
            "predict",
            "--model",
            str(model),
            "--prototypes",
            str(protos),
            "--fit",
            "--fit-limit",
            "2000",
            "--limit",
            "300",
            "--show",
            "2",
            "--out",
            str(preds),
        ],
    )
    assert r.exit_code == 0, r.output
    assert "wrote 10 prototypes" in r.output and "accuracy" in r.output
    acc = float(r.output.split("accuracy ")[1].split("%")[0])
    assert acc > 40.0  # random mlp features + class means: far above 10% chance on Fashion-MNIST
    assert len(preds.read_text().splitlines()) == 301
    r = runner.invoke(
        app, ["predict", "--model", str(model), "--prototypes", str(protos), "--limit", "50", "--metric", "cosine"]
    )
    assert r.exit_code == 0, r.output


def test_predict_input_errors(tmp_path: Path) -> None:
    r = runner.invoke(app, ["predict", "--model", str(tmp_path / "no.onnx"), "--prototypes", "p.npz"])
    assert r.exit_code == 2 and "no.onnx does not exist" in r.output
    model = tmp_path / "f.onnx"
    export_onnx(build_model("mlp", (1, 28, 28), 10, seed=0), model, exporter="torchscript")
    r = runner.invoke(app, ["predict", "--model", str(model), "--prototypes", str(tmp_path / "none.npz")])
    assert r.exit_code == 2 and "none.npz does not exist; pass --fit" in r.output
    save_prototypes(tmp_path / "p.npz", {0: np.zeros(3, np.float32)})
    r = runner.invoke(
        app,
        [
            "predict",
            "--model",
            str(model),
            "--prototypes",
            str(tmp_path / "p.npz"),
            "--data",
            f"npz:{tmp_path / 'missing.npz'}",
        ],
    )
    assert r.exit_code == 2 and "missing.npz does not exist" in r.output
