"""int8 quantisation: nearest-prototype accuracy on Fashion-MNIST, fp32 vs int8, for a briefly trained cnn."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_agent.inference.onnx_export import export_onnx
from edge_agent.inference.onnx_runtime import read_metadata
from export.checkpoint import load_model
from export.quantize import compare_accuracy, quantize_model
from protofl.data import load_images
from protofl.errors import ConfigError
from tests.export.conftest import needs_fmnist

pytestmark = needs_fmnist


@pytest.fixture(scope="module")
def fp32(trained_cnn: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = load_model(None, trained_cnn)
    return export_onnx(model, tmp_path_factory.mktemp("q") / "cnn.onnx", mean=(0.286,), std=(0.353,)).path


@pytest.fixture(scope="module")
def images():
    x_tr, y_tr, _ = load_images("fashion-mnist", "train", 5000, seed=11)  # prototypes from training data
    x_te, y_te, _ = load_images("fashion-mnist", "test", 4000, seed=11)
    return x_tr, y_tr, x_te, y_te


@pytest.mark.parametrize("mode", ["dynamic", "static"])
def test_int8_accuracy_drop_under_one_point_for_cnn(fp32: Path, images, tmp_path: Path, mode: str) -> None:
    x_tr, y_tr, x_te, y_te = images
    calib = x_tr[:256] if mode == "static" else None
    int8 = quantize_model(fp32, tmp_path / f"cnn-{mode}.onnx", mode, calib)
    rep = compare_accuracy(fp32, int8, mode, x_tr, y_tr, x_te, y_te, 10)
    print(rep.summary())
    assert rep.fp32_acc > 0.6, f"the 1-epoch cnn should be well above chance: {rep.summary()}"
    assert rep.drop_points < 1.0, rep.summary()
    assert rep.int8_bytes < rep.fp32_bytes / 3  # weights stored as int8
    meta = read_metadata(int8)
    assert meta["quantization"] == f"{mode}-int8" and meta["arch"] == "cnn"  # metadata survives


def test_static_needs_calibration_and_modes_are_checked(fp32: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="static quantisation needs calibration images"):
        quantize_model(fp32, tmp_path / "s.onnx", "static", None)
    with pytest.raises(ConfigError, match="--mode must be one of dynamic, static"):
        quantize_model(fp32, tmp_path / "s.onnx", "int4")
    with pytest.raises(ConfigError, match="does not exist"):
        quantize_model(tmp_path / "absent.onnx", tmp_path / "s.onnx")
