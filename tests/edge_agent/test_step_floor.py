"""min_local_steps (issue 56): a round trains at least that many SGD steps, whole epochs then part of one more."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from edge_agent.training.trainer import sgd_epochs
from protofl.fields import MIN_LOCAL_STEPS
from protofl.presets import make_config


class _CE:
    fixed_head = False

    def loss(self, z: torch.Tensor, y: torch.Tensor, head: torch.nn.Module) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(head(z), y)


def _steps(n: int, **cfg: Any) -> int:
    torch.manual_seed(0)
    model = SimpleNamespace(features=torch.nn.Linear(4, 8), head=torch.nn.Linear(8, 3))
    params = [*model.features.parameters(), *model.head.parameters()]
    x, y = torch.randn(n, 4), torch.randint(0, 3, (n,))
    config = make_config("fedavg", num_classes=3, in_shape=(1, 2, 2), **cfg)
    return sgd_epochs(model, params, x, y, config, _CE(), seed=0).steps  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "n, cfg, want",
    [
        (190, {"min_local_steps": 0}, 3),  # ceil(190 / 64): one epoch, the 3 steps
        (190, {"min_local_steps": 20}, 20),  # 6 whole epochs (18 steps) and 2 steps of a 7th
        (190, {"min_local_steps": 20, "local_epochs": 8}, 24),  # the floor never cuts epochs asked for
        (6000, {"min_local_steps": 20}, 94),  # a large set: one epoch is over the floor, unchanged
        (1, {"min_local_steps": 20}, 0),  # nothing to train on (a single sample): no endless loop
        (130, {"min_local_steps": 7, "batch_size": 64, "drop_last": True}, 7),  # 2 full batches an epoch
    ],
)
def test_a_round_takes_at_least_min_local_steps(n: int, cfg: dict, want: int) -> None:
    assert _steps(n, **cfg) == want


def test_the_default_floor() -> None:
    assert make_config("protofl").min_local_steps == MIN_LOCAL_STEPS == 20
    # it travels only when changed: a device of an earlier version still joins a federation at the default
    assert "min_local_steps" not in make_config("protofl").to_dict()
    assert make_config("protofl", min_local_steps=0).to_dict()["min_local_steps"] == 0
