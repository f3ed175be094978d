"""OnnxExtractor == TorchExtractor on real images, re-export only when weights change, the agent option."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from broker_server.simulation import SimulationSpec, run_simulation
from edge_agent.core.agent import EdgeAgent
from edge_agent.inference.extractor import OnnxExtractor, TorchExtractor, make_extractor, weight_fingerprint
from edge_agent.techniques.fedpagr import cosine_probabilities
from edge_agent.training.models import build_model
from protofl.data import FASHION_MNIST_DIR
from protofl.errors import ConfigError

TOL = 1e-4


@pytest.fixture(scope="module")
def images() -> np.ndarray:
    if not Path(FASHION_MNIST_DIR).is_dir():
        pytest.skip(f"Fashion-MNIST not installed at {FASHION_MNIST_DIR} (CI installs it)")
    from protofl.data import load_images

    return load_images("fashion-mnist", "test", 200)[0]


@pytest.mark.parametrize("arch", ["cnn", "resnet8"])
def test_onnx_matches_torch_on_real_images(arch: str, images: np.ndarray) -> None:
    model = build_model(arch, (1, 28, 28), 10, seed=2)
    t, o = TorchExtractor(model), OnnxExtractor(model)
    assert np.abs(o.embed(images) - t.embed(images)).max() < TOL
    assert np.abs(o.predict_proba(images) - t.predict_proba(images)).max() < TOL
    P = torch.nn.functional.normalize(torch.randn(10, 512, generator=torch.Generator().manual_seed(0)), dim=1)
    cosine = [cosine_probabilities(e.embed(images), P, 0.1) for e in (o, t)]  # FedPAGR's classifier
    assert np.abs(cosine[0] - cosine[1]).max() < TOL
    assert o.embed(images[:1]).shape == (1, 512) and o.embed(images[:0]).shape == (0, 512)


def test_reexports_only_when_weights_change(images: np.ndarray) -> None:
    model = build_model("cnn", (1, 28, 28), 10, seed=0)
    o, t = OnnxExtractor(model), TorchExtractor(model)
    o.embed(images)
    o.predict_proba(images)
    assert o.exports == 1  # one round, many extractions, one export
    with torch.no_grad():
        model.adapter.up.weight.add_(0.01)  # what a training step does
    assert np.abs(o.embed(images) - t.embed(images)).max() < TOL  # never a stale graph
    assert o.exports == 2
    bn = build_model("resnet8", (1, 28, 28), 10, seed=0)
    before = weight_fingerprint(bn)
    bn.train()
    bn(torch.from_numpy(images[:8]))  # only BatchNorm running statistics move
    assert weight_fingerprint(bn) != before  # buffers are part of the fingerprint


def test_frozen_backbone_exports_once(images: np.ndarray) -> None:
    model = build_model("resnet8", (1, 28, 28), 10, seed=0)
    o, t = OnnxExtractor(model, frozen_backbone=True), TorchExtractor(model)
    o.embed(images)
    with torch.no_grad():
        model.adapter.up.weight.add_(0.01)
        model.get_parameter("stem.weight").mul_(1.1)
    assert np.abs(o.embed(images) - t.embed(images)).max() < TOL
    assert o.exports == 1  # only the backbone is in the graph, and it did not change


def test_exporter_fallback(images: np.ndarray, monkeypatch: pytest.MonkeyPatch) -> None:
    from edge_agent.inference import onnx_export

    def gone(*args, **kwargs):
        raise RuntimeError("TorchScript exporter removed (simulated)")

    monkeypatch.setattr(onnx_export, "_export_torchscript", gone)  # the extractor's first choice
    model = build_model("mlp", (1, 28, 28), 10, seed=0)
    o = OnnxExtractor(model)
    assert np.abs(o.embed(images) - TorchExtractor(model).embed(images)).max() < TOL  # dynamo took over


def test_unknown_extractor_is_refused() -> None:
    with pytest.raises(ConfigError, match="extractor must be one of torch, onnx"):
        make_extractor("tflite", build_model("mlp", (1, 28, 28), 10, seed=0))
    with pytest.raises(ConfigError, match="extractor must be one of torch, onnx"):
        EdgeAgent("c", "f", None, extractor="tflite")  # type: ignore[arg-type]


def test_agent_with_onnx_extractor_matches_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    # The simulator builds EdgeAgent with the default extractor; switch the default to run the same
    # federation with prototypes and metrics on onnxruntime.
    spec = SimulationSpec(
        preset="fedproto", dataset="synthetic:n=400,n_test=100", clients=2, rounds=2, seed=1, test_every=1
    )
    ref = run_simulation(spec)
    defaults = EdgeAgent.__init__.__kwdefaults__
    assert defaults is not None
    monkeypatch.setitem(defaults, "extractor", "onnx")
    got = run_simulation(spec)
    for a, b in zip(ref["rounds"], got["rounds"], strict=True):
        for key in ("local_acc", "global_acc", "ensemble_acc"):
            assert abs(a[key] - b[key]) <= 0.02, (key, a, b)  # z agrees to ~1e-7: at most a tie flips
        assert a["uplink_bytes"] == b["uplink_bytes"]


@pytest.mark.parametrize("arch", ["resnet8", "mobilenetv2"])
def test_the_device_session_gives_torchs_embeddings(arch: str, images: np.ndarray, tmp_path: Path) -> None:
    # The session as the device builds it (ORT_ENABLE_ALL: BN folded into conv, NCHWc layouts, fused ops) on a
    # features graph whose batch norms hold non-trivial statistics, as after training: torch's z to float32
    # tolerance, at batch 1 and 64.
    from edge_agent.inference.onnx_export import export_onnx
    from edge_agent.inference.onnx_runtime import embed_onnx, session
    from edge_agent.training.trainer import embed

    model = build_model(arch, (1, 28, 28), 10, seed=3)
    g = torch.Generator().manual_seed(0)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            assert m.running_mean is not None and m.running_var is not None
            m.running_mean.copy_(0.1 * torch.randn(m.running_mean.shape, generator=g))
            m.running_var.copy_(0.5 + torch.rand(m.running_var.shape, generator=g))
    sess = session(export_onnx(model, tmp_path / "f.onnx", exporter="torchscript").path, threads=1)
    for n in (1, 64):
        np.testing.assert_allclose(embed_onnx(sess, images[:n]), embed(model, images[:n]), rtol=1e-4, atol=1e-5)
