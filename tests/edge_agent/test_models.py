"""The model zoo: every architecture builds and runs, the client-model structure, seeded determinism."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from edge_agent.training import models
from edge_agent.training.models import (
    ARCHITECTURES,
    BUILTIN_ARCHITECTURES,
    ConsensusProjection,
    ProtoNet,
    ResidualAdapter,
    available_architectures,
    build_model,
)
from edge_agent.training.params import full_vector
from protofl.errors import ConfigError

SHAPES = [(1, 28, 28), (3, 32, 32)]
# Backbone output dims h, fixed by the spec of each architecture.
H_DIMS = {
    "cnn": 512,
    "mlp": 512,
    "resnet8": 64,
    "resnet18": 512,
    "mobilenetv2": 256,
    "tv_resnet18": 512,
    "tv_mobilenet_v3_small": 576,
}


def test_architecture_list() -> None:
    assert BUILTIN_ARCHITECTURES == ("cnn", "mlp", "resnet8", "resnet18", "mobilenetv2")
    assert ARCHITECTURES[:5] == BUILTIN_ARCHITECTURES
    assert available_architectures() == list(ARCHITECTURES)
    # torchvision ones are offered exactly when torchvision imports.
    assert ("tv_resnet18" in ARCHITECTURES) == models._torchvision_available()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_architecture_builds_and_runs(arch: str, shape: tuple[int, int, int]) -> None:
    model = build_model(arch, shape, num_classes=10, seed=0)
    assert isinstance(model, ProtoNet)
    assert (model.arch, model.in_shape, model.num_classes, model.proto_dim) == (arch, shape, 10, 512)
    assert model.backbone_dim == H_DIMS[arch]
    # The stem exists only where dim(h) != m.
    if H_DIMS[arch] == 512:
        assert isinstance(model.stem, nn.Identity)
    else:
        assert isinstance(model.stem, nn.Linear)
        assert (model.stem.in_features, model.stem.out_features) == (H_DIMS[arch], 512)
    assert model.projection is None

    x = torch.randn(2, *shape)
    logits = model(x)  # train mode with a batch of 2 (BatchNorm needs > 1 sample)
    assert logits.shape == (2, 10)
    model.eval()
    with torch.no_grad():
        h = model.backbone_features(x)
        z = model.features(x)
        assert h.shape == (2, H_DIMS[arch])
        assert z.shape == (2, 512)
        # The cached-h path gives the same z, and the logits are head(z).
        torch.testing.assert_close(model.features_from_backbone(h), z)
        torch.testing.assert_close(model(x), model.head(z))
        # W_up starts at zero, so the adapter starts as the identity: z == stem(h).
        torch.testing.assert_close(z, model.stem(h))


def test_stem_identity_iff_backbone_dim_equals_proto_dim() -> None:
    assert isinstance(build_model("cnn", (1, 28, 28), 10, proto_dim=512).stem, nn.Identity)
    stem = build_model("cnn", (1, 28, 28), 10, proto_dim=128).stem
    assert isinstance(stem, nn.Linear) and (stem.in_features, stem.out_features) == (512, 128)
    assert isinstance(build_model("resnet8", (1, 28, 28), 10, proto_dim=64).stem, nn.Identity)
    assert isinstance(build_model("mobilenetv2", (1, 28, 28), 10, proto_dim=256).stem, nn.Identity)
    m = build_model("mlp", (1, 28, 28), 7, proto_dim=100, adapter_rank=8)
    assert m(torch.randn(3, 1, 28, 28)).shape == (3, 7)
    assert m.features(torch.randn(3, 1, 28, 28)).shape == (3, 100)


def test_residual_adapter_starts_as_identity_and_learns() -> None:
    adapter = ResidualAdapter(16, rank=4)
    assert (adapter.down.in_features, adapter.down.out_features) == (16, 4)
    assert (adapter.up.in_features, adapter.up.out_features) == (4, 16)
    assert torch.count_nonzero(adapter.up.weight) == 0 and torch.count_nonzero(adapter.up.bias) == 0
    h = torch.randn(5, 16)
    torch.testing.assert_close(adapter(h), h)
    # W_up gets gradient at step 0 (relu(W_down h) != 0), so the adapter can move away from identity.
    (adapter(h) ** 2).sum().backward()
    assert adapter.up.weight.grad is not None and adapter.up.weight.grad.abs().sum() > 0


def test_projection_variant() -> None:
    model = build_model("cnn", (1, 28, 28), 10, projection=True, seed=1)
    assert isinstance(model.projection, ConsensusProjection)
    kinds = [type(m) for m in model.projection]
    assert kinds == [nn.Linear, nn.LayerNorm, nn.ReLU, nn.Dropout, nn.Linear, nn.LayerNorm]
    first, last = model.projection[0], model.projection[4]
    assert isinstance(first, nn.Linear) and isinstance(last, nn.Linear)
    assert (first.in_features, first.out_features) == (512, 1024)
    assert (last.in_features, last.out_features) == (1024, 512)
    assert model.projection[3].p == 0.1
    model.eval()
    x = torch.randn(3, 1, 28, 28)
    with torch.no_grad():
        z = model.features(x)
        h = model.backbone_features(x)
        torch.testing.assert_close(z, model.projection(model.adapter(model.stem(h))))
        torch.testing.assert_close(model(x), model.head(z))
    assert z.shape == (3, 512)
    # The final LayerNorm (weight 1, bias 0 at init) makes each row zero-mean, unit-variance.
    torch.testing.assert_close(z.mean(dim=1), torch.zeros(3), atol=1e-5, rtol=0)
    # Not normalised to the unit sphere: features() returns z as is (FedPAGR normalises in its loss).
    assert not torch.allclose(z.norm(dim=1), torch.ones(3))


def test_seeded_construction_is_bit_identical_and_seed_dependent() -> None:
    a = full_vector(build_model("resnet8", (3, 32, 32), 10, seed=7))
    b = full_vector(build_model("resnet8", (3, 32, 32), 10, seed=7))
    c = full_vector(build_model("resnet8", (3, 32, 32), 10, seed=8))
    assert a.tobytes() == b.tobytes()
    assert a.tobytes() != c.tobytes()


def test_seeded_construction_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    build_model("cnn", (1, 28, 28), 10, seed=5)
    torch.testing.assert_close(torch.rand(4), expected, rtol=0, atol=0)


_HASH_SNIPPET = (
    "import hashlib; from edge_agent.training.models import build_model; from edge_agent.training.params import "
    "full_vector; "
    "print(hashlib.sha256(full_vector(build_model('cnn', (1, 28, 28), 10, projection=True, seed=11))"
    ".tobytes()).hexdigest())"
)


def test_seeded_construction_is_identical_across_processes() -> None:
    here = hashlib.sha256(
        full_vector(build_model("cnn", (1, 28, 28), 10, projection=True, seed=11)).tobytes()
    ).hexdigest()
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # A different global seed in the child must not matter either.
    code = "import torch; torch.manual_seed(999); " + _HASH_SNIPPET
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == here


def test_unknown_architecture_names_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown architecture 'vgg99'; known: cnn, mlp, resnet8"):
        build_model("vgg99", (1, 28, 28), 10)


@pytest.mark.parametrize("shape", [(1, 28), (0, 28, 28), (1, -3, 28), ("a", 2, 2)])
def test_bad_input_shape(shape: tuple) -> None:
    with pytest.raises(ConfigError, match="in_shape"):
        build_model("mlp", shape, 10)


def test_cnn_rejects_images_too_small_for_two_pools() -> None:
    with pytest.raises(ConfigError, match="at least 4x4"):
        build_model("cnn", (1, 3, 3), 10)


def test_bad_sizes() -> None:
    with pytest.raises(ConfigError, match="num_classes"):
        build_model("mlp", (1, 28, 28), 0)
    with pytest.raises(ConfigError, match="adapter_rank"):
        build_model("mlp", (1, 28, 28), 10, adapter_rank=0)


def test_odd_image_sizes_work() -> None:
    # Flatten sizes are computed from in_shape (floor division by the pools), not assumed 28 or 32.
    for arch in ("cnn", "mlp", "resnet8", "mobilenetv2"):
        model = build_model(arch, (2, 19, 23), 4, seed=0)
        assert model(torch.randn(2, 2, 19, 23)).shape == (2, 4)
