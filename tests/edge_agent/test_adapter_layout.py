"""The server's numpy view of the adapter must match the device's torch model exactly."""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent.training.models import build_model
from edge_agent.training.params import adapter_layout as torch_layout
from edge_agent.training.params import adapter_vector, load_adapter_vector
from protofl.adapter import adapter_layout, initial_adapter, layout_size


@pytest.mark.parametrize("m, r, c", [(512, 32, 10), (64, 8, 3)])
def test_numpy_layout_matches_torch_model(m: int, r: int, c: int) -> None:
    model = build_model("mlp", (1, 8, 8), c, proto_dim=m, adapter_rank=r, seed=0)
    assert [(n, tuple(s)) for n, s in torch_layout(model)] == adapter_layout(m, r, c)
    assert layout_size(adapter_layout(m, r, c)) == adapter_vector(model).shape[0]


def test_initial_adapter_is_identity_and_loads() -> None:
    layout = adapter_layout(16, 4, 3)
    theta = initial_adapter(layout, seed=1)
    assert theta.shape == (16 * 4 + 4 + 4 * 16 + 16 + 3 * 16 + 3,)
    # W_up and b_up start at zero (A_f = identity); W_down within U(-1/sqrt(16), 1/sqrt(16)).
    up = theta[16 * 4 + 4 : 16 * 4 + 4 + 4 * 16 + 16]
    assert not up.any()
    assert np.abs(theta[: 16 * 4]).max() <= 0.25
    assert np.array_equal(theta, initial_adapter(layout, seed=1))
    assert not np.array_equal(theta, initial_adapter(layout, seed=2))
    model = build_model("mlp", (1, 8, 8), 3, proto_dim=16, adapter_rank=4, seed=0)
    load_adapter_vector(model, theta)
    assert np.array_equal(adapter_vector(model), theta)
