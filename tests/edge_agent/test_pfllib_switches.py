"""The switches that make our local training behave as PFLlib's FedProto does (bench/fedproto_gap.py):
drop_last, keep_optimizer, proto_source. Each off by default; each does what it says when on."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from edge_agent.techniques import Objective
from edge_agent.training import trainer
from edge_agent.training.models import build_model
from protofl.config import FederationConfig
from protofl.errors import ConfigError
from protofl.wire import RoundStart
from tests.edge_agent.test_agent import setup, start_round


def _problem(n: int = 22, seed: int = 0):
    # PFLlib's loop: one epoch a round, no step floor (min_local_steps=0, issue 56; tests/edge_agent/test_step_floor.py)
    cfg = FederationConfig(
        federate="none",
        proto_dim=16,
        adapter_rank=4,
        archs=("mlp",),
        in_shape=(1, 4, 4),
        num_classes=3,
        batch_size=8,
        min_local_steps=0,
    )
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 1, 4, 4, generator=g), torch.randint(0, 3, (n,), generator=g)
    model = build_model("mlp", cfg.in_shape, cfg.num_classes, cfg.proto_dim, cfg.adapter_rank, seed=seed)
    return cfg, model, x, y


def test_defaults_are_todays_behaviour_and_travel_only_when_set() -> None:
    cfg = FederationConfig()
    assert (cfg.drop_last, cfg.keep_optimizer, cfg.proto_source) == (False, False, "after")
    # At their defaults they are not in the config message: the bytes (and earlier devices) see no change.
    assert not {"drop_last", "keep_optimizer", "proto_source"} & set(cfg.to_dict())
    on = cfg.replace(drop_last=True, proto_source="during")
    assert on.to_dict()["drop_last"] is True and on.to_dict()["proto_source"] == "during"
    assert FederationConfig.from_dict(on.to_dict()) == on and "keep_optimizer" not in on.to_dict()


@pytest.mark.parametrize("bad", [dict(drop_last=1), dict(keep_optimizer="yes"), dict(proto_source="before")])
def test_bad_values_are_refused_with_the_choices(bad: dict) -> None:
    with pytest.raises(ConfigError, match=next(iter(bad))):
        FederationConfig(**bad)


def test_drop_last_skips_each_epochs_short_batch() -> None:
    cfg, model, x, y = _problem(n=22)  # batches of 8, 8, 6
    assert trainer.train_local(copy.deepcopy(model), x, y, cfg, Objective(), seed=0).steps == 3
    cfg2 = cfg.replace(drop_last=True, local_epochs=2)
    assert trainer.train_local(model, x, y, cfg2, Objective(), seed=0).steps == 4


def _torch_sgd_rounds(model, x, y, cfg, seeds) -> None:
    """The reference: one torch.optim.SGD for every round, the trainer's batch order per round."""
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    model.train()
    for seed in seeds:
        order = torch.from_numpy(np.random.default_rng(seed).permutation(len(y)))
        for i in range(0, len(y), cfg.batch_size):
            idx = order[i : i + cfg.batch_size]
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()


def test_keep_optimizer_carries_momentum_across_rounds_as_one_torch_optimizer_does() -> None:
    cfg, model, x, y = _problem(n=24)
    kept, fresh, ref = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)
    buffers: trainer.Momentum = {}
    for r in (1, 2):
        trainer.train_local(kept, x, y, cfg, Objective(), seed=r, momentum=buffers)
        trainer.train_local(fresh, x, y, cfg, Objective(), seed=r)
    assert set(buffers) == {name for name, _ in model.named_parameters()}
    _torch_sgd_rounds(ref, x, y, cfg, seeds=(1, 2))
    for (name, a), b in zip(kept.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{name}: kept momentum != one torch optimiser")
    assert any(not torch.allclose(a, c) for a, c in zip(kept.parameters(), fresh.parameters(), strict=True)), (
        "a kept optimiser must train differently from a fresh one in round 2"
    )


def test_proto_source_during_returns_the_features_each_step_saw() -> None:
    cfg, model, x, y = _problem(n=22)
    start = copy.deepcopy(model)
    assert trainer.train_local(copy.deepcopy(model), x, y, cfg, Objective(), seed=3).seen is None  # "after"
    stats = trainer.train_local(model, x, y, cfg.replace(proto_source="during", drop_last=True), Objective(), seed=3)
    assert stats.seen is not None
    z, labels = stats.seen
    order = np.random.default_rng(3).permutation(22)[:16]  # the two full batches; the short one dropped
    assert z.shape == (16, 16) and labels.tolist() == y.numpy()[order].tolist()
    with torch.no_grad():  # the first batch was embedded by the untrained model, before its step
        torch.testing.assert_close(torch.from_numpy(z[:8]), start.features(x[torch.from_numpy(order[:8])]))
        assert not torch.allclose(torch.from_numpy(z[8:]), start.features(x[torch.from_numpy(order[8:])]))


def test_agent_uploads_the_mean_of_what_training_saw_with_proto_source_during() -> None:
    # 40 samples (20 per class), two local epochs (no step floor: PFLlib's loop): "during" averages 40 features per
    # class, "after" 20.
    _, broker, server, agent, uploads = setup("fedproto", local_epochs=2, proto_source="during", min_local_steps=0)
    start_round(broker, server, 1, RoundStart(deadline=0.0))
    assert uploads[1][1].local.counts.tolist() == [40, 40]
    _, broker, server, agent, uploads = setup("fedproto", local_epochs=2)
    start_round(broker, server, 1, RoundStart(deadline=0.0))
    assert uploads[1][1].local.counts.tolist() == [20, 20]


def test_agent_keeps_momentum_between_rounds_only_when_asked() -> None:
    _, broker, server, agent, _ = setup("fedproto", keep_optimizer=True)
    start_round(broker, server, 1, RoundStart(deadline=0.0))
    assert set(agent._momentum) == {name for name, _ in agent.model.named_parameters()}
    _, broker, server, agent, _ = setup("fedproto")
    start_round(broker, server, 1, RoundStart(deadline=0.0))
    assert agent._momentum == {}
