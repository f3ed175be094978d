"""Parameter flattening: the declared adapter order, round trips, the FedAvg vector."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from edge_agent.training.models import BUILTIN_ARCHITECTURES, ResidualAdapter, build_model
from edge_agent.training.params import (
    adapter_layout,
    adapter_modules,
    adapter_vector,
    count_parameters,
    full_layout,
    full_vector,
    load_adapter_vector,
    load_full_vector,
)

M, R, C = 512, 32, 10
# d by hand: W_down (32x512) + b_down (32) + W_up (512x32) + b_up (512) + head W (10x512) + head b (10).
D = 2 * 512 * 32 + 32 + 512 + 512 * 10 + 10  # = 38442
EXPECTED_LAYOUT = [
    ("adapter.down.weight", (32, 512)),
    ("adapter.down.bias", (32,)),
    ("adapter.up.weight", (512, 32)),
    ("adapter.up.bias", (512,)),
    ("head.weight", (10, 512)),
    ("head.bias", (10,)),
]


def test_adapter_modules_are_adapter_then_head() -> None:
    model = build_model("mlp", (1, 28, 28), C)
    mods = adapter_modules(model)
    assert [name for name, _ in mods] == ["adapter", "head"]
    assert mods[0][1] is model.adapter and mods[1][1] is model.head


@pytest.mark.parametrize("arch", BUILTIN_ARCHITECTURES)
def test_adapter_layout_is_the_same_for_every_backbone(arch: str) -> None:
    # Heterogeneous clients federate the same theta_a: the layout must not depend on the backbone,
    # nor on the private projection.
    model = build_model(arch, (1, 28, 28), C, projection=(arch == "cnn"))
    assert adapter_layout(model) == EXPECTED_LAYOUT
    vec = adapter_vector(model)
    assert vec.dtype == np.float32 and vec.shape == (D,) and D == 38442


def test_adapter_vector_round_trip_and_slices() -> None:
    model = build_model("resnet8", (1, 28, 28), C, seed=0)
    backbone_before = full_vector(model.backbone)
    rng = np.random.default_rng(0)
    new = rng.standard_normal(D).astype(np.float32)
    load_adapter_vector(model, new)
    np.testing.assert_array_equal(adapter_vector(model), new)
    # Declared order: the head bias is the last 10 values, W_down the first 32*512 (row-major).
    np.testing.assert_array_equal(model.head.bias.detach().numpy(), new[-10:])
    down_w = model.adapter.down.weight.detach().numpy()
    np.testing.assert_array_equal(down_w, new[: 32 * 512].reshape(32, 512))
    up_b_start = 32 * 512 + 32 + 512 * 32  # after W_down, b_down, W_up
    np.testing.assert_array_equal(model.adapter.up.bias.detach().numpy(), new[up_b_start : up_b_start + 512])
    # Nothing outside theta_a moved.
    np.testing.assert_array_equal(full_vector(model.backbone), backbone_before)


def test_adapter_vector_is_a_copy() -> None:
    model = build_model("mlp", (1, 28, 28), C, seed=0)
    vec = adapter_vector(model)
    vec[:] = 5.0
    assert not np.any(adapter_vector(model) == 5.0)


def test_load_adapter_vector_accepts_float64() -> None:
    model = build_model("mlp", (1, 28, 28), C, seed=0)
    vec = np.linspace(-1, 1, D)  # float64
    load_adapter_vector(model, vec)
    np.testing.assert_array_equal(adapter_vector(model), vec.astype(np.float32))


def test_load_adapter_vector_wrong_length_names_both_and_writes_nothing() -> None:
    model = build_model("mlp", (1, 28, 28), C, seed=0)
    before = adapter_vector(model)
    with pytest.raises(ValueError, match=rf"expected {D}, got {D - 1}"):
        load_adapter_vector(model, np.zeros(D - 1, dtype=np.float32))
    with pytest.raises(ValueError, match="1-D"):
        load_adapter_vector(model, np.zeros((2, D // 2), dtype=np.float32))
    np.testing.assert_array_equal(adapter_vector(model), before)


def test_full_layout_has_bn_statistics_but_not_the_step_counter() -> None:
    model = build_model("resnet8", (1, 28, 28), C, seed=0)
    names = [n for n, _ in full_layout(model)]
    assert "backbone.stem.1.running_mean" in names and "backbone.stem.1.running_var" in names
    assert not any(n.endswith("num_batches_tracked") for n in names)
    # state_dict order.
    sd_float = [k for k, v in model.state_dict().items() if v.is_floating_point()]
    assert names == sd_float
    n_buffers = sum(b.numel() for n, b in model.named_buffers() if b.is_floating_point())
    assert full_vector(model).size == count_parameters(model) + n_buffers
    assert sum(int(np.prod(s)) for _, s in full_layout(model)) == full_vector(model).size


def test_full_vector_round_trip_makes_models_equal() -> None:
    a = build_model("resnet8", (1, 28, 28), C, seed=1)
    b = build_model("resnet8", (1, 28, 28), C, seed=2)
    a.train()
    with torch.no_grad():
        a(torch.randn(4, 1, 28, 28))  # move BN running statistics away from their init
    load_full_vector(b, full_vector(a))
    np.testing.assert_array_equal(full_vector(b), full_vector(a))
    a.eval()
    b.eval()
    x = torch.randn(3, 1, 28, 28)
    with torch.no_grad():
        torch.testing.assert_close(b(x), a(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="expected"):
        load_full_vector(b, np.zeros(10, dtype=np.float32))


def test_count_parameters() -> None:
    assert count_parameters(ResidualAdapter(M, R)) == 2 * M * R + R + M
    assert count_parameters(nn.Linear(512, 10)) == 5130
    model = build_model("mlp", (1, 28, 28), C)
    # mlp: 784*512 + 512 + 512*512 + 512; no stem (h = 512 = m).
    backbone = 784 * 512 + 512 + 512 * 512 + 512
    assert count_parameters(model.backbone) == backbone
    assert count_parameters(model) == backbone + D
    for p in model.backbone.parameters():
        p.requires_grad_(False)
    assert count_parameters(model, trainable_only=True) == D
