"""Local training: which parameters a round updates."""

from __future__ import annotations

import pytest
import torch

from edge_agent.core.frozen import train_on_cached_features
from edge_agent.techniques.fedpagr import pagr_objective
from edge_agent.training import trainer
from edge_agent.training.models import ProtoNet, build_model
from protofl.config import FederationConfig
from protofl.errors import ConfigError


def _pagr_round(train_head: bool, frozen: bool = False) -> tuple[torch.Tensor, torch.Tensor, ProtoNet]:
    cfg = FederationConfig(
        federate="none",
        prototypes="unit",
        consensus=True,
        proto_dim=16,
        adapter_rank=4,
        archs=("mlp",),
        pagr_train_head=train_head,
        backbone="frozen" if frozen else "train",
    )
    model = build_model("mlp", cfg.in_shape, cfg.num_classes, cfg.proto_dim, cfg.adapter_rank, projection=True, seed=0)
    gen = torch.Generator().manual_seed(1)
    P = torch.nn.functional.normalize(torch.randn(cfg.num_classes, cfg.proto_dim, generator=gen), dim=1)
    with torch.no_grad():  # the agent anchors the head at round start: rows := P, bias 0
        model.head.weight.copy_(P)
        model.head.bias.zero_()
    targets = pagr_objective(P, cfg.beta, cfg.lambda_e, train_head=train_head, cosine=True)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(64, *cfg.in_shape, generator=g), torch.randint(0, cfg.num_classes, (64,), generator=g)
    assert model.projection is not None
    before = [p.detach().clone() for p in model.projection.parameters()]
    if frozen:
        with torch.no_grad():
            h = model.backbone(x)
        train_on_cached_features(model, h, y, cfg, targets, seed=0)
    else:
        trainer.train_local(model, x, y, cfg, targets, seed=0)
    moved = any(not torch.equal(b, p) for b, p in zip(before, model.projection.parameters(), strict=True))
    assert moved, "the consensus projection g_k must train"
    return model.head.weight.detach(), P, model


@pytest.mark.parametrize("frozen", [False, True])
def test_fedpagr_head_stays_anchored_during_the_round(frozen: bool) -> None:
    weight, P, model = _pagr_round(train_head=False, frozen=frozen)
    assert torch.equal(weight, P)  # not even weight decay or momentum touched it
    assert torch.equal(model.head.bias.detach(), torch.zeros_like(model.head.bias))


def test_pagr_train_head_variant_trains_the_head() -> None:
    weight, P, _ = _pagr_round(train_head=True)
    assert not torch.equal(weight, P)


def test_pagr_train_head_needs_fedpagr() -> None:
    with pytest.raises(ConfigError, match="pagr_train_head"):
        FederationConfig(pagr_train_head=True)
    with pytest.raises(ConfigError, match="true or false"):
        FederationConfig(erpa="yes")
