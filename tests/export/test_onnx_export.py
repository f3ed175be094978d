"""Every built-in architecture exports, passes the ONNX checker and matches PyTorch within 1e-4 on real inputs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from edge_agent.inference import onnx_export
from edge_agent.inference.onnx_export import ExportInfo, export_onnx
from edge_agent.inference.onnx_runtime import read_metadata, session
from edge_agent.training.models import BUILTIN_ARCHITECTURES, ProtoNet, build_model
from export.verify import verify_onnx
from protofl.errors import ConfigError
from tests.export.conftest import needs_fmnist

pytestmark = needs_fmnist


def _exported(tmp_path: Path, arch: str, what: str, **kw: Any) -> tuple[ExportInfo, ProtoNet]:
    model = build_model(arch, (1, 28, 28), 10, seed=0)
    info = export_onnx(model, tmp_path / f"{arch}-{what}.onnx", what=what, mean=(0.286,), std=(0.353,), **kw)
    return info, model


@pytest.mark.parametrize("arch", BUILTIN_ARCHITECTURES)
def test_features_export_checks_and_matches_torch(tmp_path: Path, arch: str, fmnist_test) -> None:
    x, _ = fmnist_test
    info, model = _exported(tmp_path, arch, "features")
    assert info.exporter == "dynamo", info.fallback_reason  # the modern exporter works for the whole zoo
    onnx.checker.check_model(str(info.path), full_check=True)
    # Dynamic batch: batches of 1 and 7 (the export's example batch was 2).
    result = verify_onnx(info.path, model, x[:8], tol=1e-4)
    assert result.ok, result.summary()
    assert result.batch_sizes == (1, 7)
    assert result.max_abs_diff <= 1e-4
    print(f"{arch} features: max abs diff {result.max_abs_diff:.2e}")


@pytest.mark.parametrize("arch", ["mlp", "resnet8"])
def test_backbone_export_matches_torch(tmp_path: Path, arch: str, fmnist_test) -> None:
    x, _ = fmnist_test
    info, model = _exported(tmp_path, arch, "backbone")
    assert info.out_dim == model.backbone_dim
    result = verify_onnx(info.path, model, x[:8])
    assert result.ok, result.summary()
    sess = session(info.path)
    assert sess.get_outputs()[0].shape[1] == model.backbone_dim


def test_metadata_records_what_a_device_needs(tmp_path: Path) -> None:
    info, model = _exported(tmp_path, "cnn", "features")
    meta = read_metadata(info.path)
    assert meta["arch"] == "cnn" and meta["what"] == "features"
    assert meta["in_shape"] == "1,28,28" and meta["proto_dim"] == "512" and meta["out_dim"] == "512"
    assert meta["norm_mean"] == "0.286" and meta["norm_std"] == "0.353"
    assert meta["protofl_version"] and meta["exporter"] == "dynamo"
    inp = session(info.path).get_inputs()[0]
    assert inp.shape[0] == "batch" and inp.shape[1:] == [1, 28, 28]  # the batch axis is symbolic


def test_export_leaves_training_flags_alone(tmp_path: Path) -> None:
    model = build_model("resnet8", (1, 28, 28), 10, seed=0)
    model.train()
    model.backbone.eval()  # a frozen backbone inside a training model
    export_onnx(model, tmp_path / "m.onnx", exporter="torchscript")  # the exporter that flips modes
    assert model.training and model.adapter.training and not model.backbone.training
    assert not any(m.training for m in model.backbone.modules())


def test_legacy_exporter_and_opset(tmp_path: Path, fmnist_test) -> None:
    x, _ = fmnist_test
    info, model = _exported(tmp_path, "cnn", "features", exporter="torchscript", opset=17)
    assert info.exporter == "torchscript" and info.opset == 17
    assert verify_onnx(info.path, model, x[:8]).ok


def test_falls_back_to_torchscript_when_dynamo_fails(tmp_path: Path, monkeypatch, fmnist_test) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("onnxscript missing (simulated)")

    monkeypatch.setattr(onnx_export, "_export_dynamo", broken)
    x, _ = fmnist_test
    info, model = _exported(tmp_path, "mlp", "features")
    assert info.exporter == "torchscript"
    assert "onnxscript missing" in info.fallback_reason
    assert read_metadata(info.path)["exporter"] == "torchscript"
    assert verify_onnx(info.path, model, x[:8]).ok


def test_bad_arguments_say_what_to_do(tmp_path: Path) -> None:
    model = build_model("mlp", (1, 28, 28), 10, seed=0)
    with pytest.raises(ConfigError, match="--what must be one of features, backbone"):
        export_onnx(model, tmp_path / "m.onnx", what="head")
    with pytest.raises(ConfigError, match="one mean/std per input channel"):
        export_onnx(model, tmp_path / "m.onnx", mean=(0.1, 0.2), std=(1.0, 1.0))
    with pytest.raises(ConfigError, match="does not exist"):
        read_metadata(tmp_path / "absent.onnx")


def test_verify_reports_figures_for_other_weights(tmp_path: Path, fmnist_test) -> None:
    x, _ = fmnist_test
    info, _ = _exported(tmp_path, "cnn", "features")
    other = build_model("cnn", (1, 28, 28), 10, seed=1)
    result = verify_onnx(info.path, other, x[:16])
    assert not result.ok
    assert result.max_abs_diff > 1e-2
    assert "max |onnx - torch|" in result.summary() and "does not hold these weights" in result.summary()
    assert np.isfinite(result.mean_abs_diff)
