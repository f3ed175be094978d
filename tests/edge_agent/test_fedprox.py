"""FedProx (Li et al. 2020): the proximal term (mu/2) ||w - w^t||^2 over what the federation shares, its gradient
mu (w - w^t), the option's rules, and the term composed with another rule's in one objective."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from edge_agent.core.agent import ClientData, EdgeAgent
from edge_agent.ops.local import LocalDevice
from edge_agent.techniques import AlignmentTerm, Batch, DeviceContext, make_objective, rules_for
from edge_agent.techniques.fedprox import ProximalTerm, proximal_term, shared_parameters
from edge_agent.training import params as model_params
from edge_agent.training.models import build_model
from protofl import topics
from protofl.algorithms import cps
from protofl.algorithms.prototypes import local_prototypes
from protofl.config import FederationConfig
from protofl.errors import ConfigError
from protofl.plan import RoundPlan
from protofl.presets import make_config
from protofl.transport import InProcessBroker
from protofl.wire import Config, ProtoSet, RoundStart, encode_message

SMALL: dict[str, Any] = dict(
    num_classes=3, proto_dim=16, adapter_rank=2, in_shape=(1, 6, 6), archs=("mlp",), batch_size=8
)


def _batch() -> Batch:
    z, y = torch.zeros(2, 2), torch.zeros(2, dtype=torch.long)
    return Batch(z=z, y=y, head=torch.nn.Identity(), head_input=z)


def test_hand_example_value_and_gradient() -> None:
    # w = ([[1, 2], [3, 4]], [0.5]), w^t = ([[0, 2], [1, 1]], [1.5]), mu = 0.5:
    # w - w^t = ([[1, 0], [2, 3]], [-1]); ||.||^2 = 1 + 0 + 4 + 9 + 1 = 15; term = 0.5 / 2 * 15 = 3.75;
    # gradient mu (w - w^t) = ([[0.5, 0], [1, 1.5]], [-0.5]).
    w = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    b = torch.tensor([0.5], requires_grad=True)
    term = proximal_term([w, b], [torch.tensor([[0.0, 2.0], [1.0, 1.0]]), torch.tensor([1.5])], mu=0.5)
    assert term.item() == 3.75
    term.backward()
    assert w.grad is not None and b.grad is not None
    assert w.grad.tolist() == [[0.5, 0.0], [1.0, 1.5]] and b.grad.tolist() == [-0.5]


@pytest.mark.parametrize("federate", ["full", "adapter"])
def test_value_and_gradient_against_autograd_on_a_small_model(federate: str) -> None:
    model = build_model("mlp", (1, 6, 6), 3, 16, 2, seed=0)
    shared = shared_parameters(model, federate)
    flatten = model_params.full_vector if federate == "full" else model_params.adapter_vector
    # the parameters shared are those of the vector that travels (buffers aside: the mlp has none)
    assert sum(p.numel() for p in shared) == flatten(model).shape[0]
    if federate == "adapter":
        assert sum(p.numel() for p in shared) < sum(p.numel() for p in model.parameters())
    at_start = flatten(model).astype(np.float64)
    mu = 0.3
    term = ProximalTerm(shared, mu)
    with torch.no_grad():  # local training moves every parameter
        for i, p in enumerate(model.parameters()):
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.1)
    value = term.loss(_batch())
    moved = flatten(model).astype(np.float64) - at_start
    assert value.item() == pytest.approx(mu / 2 * float(moved @ moved), rel=1e-5)
    grads = torch.autograd.grad(value, shared)
    for g, w, ref in zip(grads, shared, term.reference, strict=True):
        torch.testing.assert_close(g, mu * (w.detach() - ref), rtol=1e-6, atol=1e-7)
    # and autograd's gradient against finite differences, in float64
    ws = [p.detach().double().requires_grad_() for p in shared[:2]]
    refs = [r.double() for r in term.reference[:2]]
    assert torch.autograd.gradcheck(lambda *xs: proximal_term(list(xs), refs, mu), tuple(ws))


def test_zero_where_w_is_the_round_start_and_skips_what_does_not_train() -> None:
    model = build_model("mlp", (1, 6, 6), 3, 16, 2, seed=0)
    shared = shared_parameters(model, "full")
    term = ProximalTerm(shared, 0.5)
    value = term.loss(_batch())
    assert value.item() == 0.0
    assert all(float(g.abs().max()) == 0.0 for g in torch.autograd.grad(value, shared))
    with torch.no_grad():
        model.head.weight.add_(1.0)  # 3 x 16 entries moved by 1
    assert term.loss(_batch()).item() == pytest.approx(0.25 * 48)
    model.head.weight.requires_grad_(False)  # a fixed head stays at w^t in training: the sum leaves it out
    assert term.loss(_batch()).item() == 0.0
    assert shared_parameters(model, "none") == list(model.parameters())  # nothing shared: the private model


def test_the_option_and_its_combination_rule() -> None:
    assert FederationConfig().prox_mu == 0.0
    assert "fedprox" not in RoundPlan.from_config(make_config("fedavg")).techniques  # 0: off
    assert "fedprox" in RoundPlan.from_config(make_config("fedavg", prox_mu=0.01)).techniques
    assert "fedprox" in RoundPlan.from_config(make_config("refprotofl", prox_mu=0.01)).techniques  # adapter
    for bad, why in ((-0.1, ">= 0"), (float("nan"), "finite"), ("x", "finite"), (True, "finite")):
        with pytest.raises(ConfigError, match=why):
            make_config("fedavg", prox_mu=bad)
    # FedProto shares no parameters: the term pulls the private model towards its own start of the round
    assert "fedprox" in RoundPlan.from_config(make_config("fedproto", prox_mu=0.01)).techniques
    make_config("fedproto", prox_mu=0.01, federate="adapter")  # FedProto with a federated adapter: the adapter


def _context(cfg: FederationConfig, masks: np.ndarray | None = None) -> tuple[DeviceContext, list]:
    plan = RoundPlan.from_config(cfg)
    model = build_model("mlp", cfg.in_shape, cfg.num_classes, cfg.proto_dim, cfg.adapter_rank, seed=cfg.seed)
    rules = rules_for(cfg, plan, Config(preset=cfg.preset, params=cfg.to_dict(), class_masks=masks))
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(24, *cfg.in_shape, generator=g), np.repeat([0, 1, 2], 8)
    ctx = DeviceContext(
        cfg=cfg, plan=plan, model=model, device=torch.device("cpu"), embed=lambda a: a, x=x, y=y, masks=masks
    )
    return ctx, rules


def test_without_prox_mu_the_objective_is_what_it_was() -> None:
    cfg = make_config("fedavg", **SMALL)
    ctx, rules = _context(cfg)
    objective = make_objective(rules, ctx, {}, fresh=True)
    assert [rule.name for rule in rules] == ["fedavg"] and objective.terms == ()
    z, y = torch.randn(8, 16), torch.arange(8) % 3
    assert torch.equal(objective.loss(z, y, ctx.model.head), F.cross_entropy(ctx.model.head(z), y))


def test_fedprox_term_acts_on_rounds_without_targets() -> None:
    cfg = make_config("fedavg", prox_mu=0.5, **SMALL)
    ctx, rules = _context(cfg)
    objective = make_objective(rules, ctx, {}, fresh=True)  # a FedAvg round carries no targets
    (term,) = objective.terms
    assert isinstance(term, ProximalTerm) and term.mu == 0.5
    assert make_objective(rules, ctx, {}, fresh=False).terms == ()  # rebuilt from a checkpoint: metrics only


def test_the_objective_sums_two_rules_terms_in_rule_order() -> None:
    # TinyProto's alignment to CPS-masked targets and FedProx's proximal term, on a federated adapter.
    cfg = make_config("tinyproto", federate="adapter", prox_mu=0.2, cps_s=4, **SMALL)
    masks = cps.make_masks(3, 16, 4, seed=0)
    ctx, rules = _context(cfg, masks)
    assert [rule.name for rule in rules] == ["fedavg", "fedproto", "cps", "fedprox"]
    table = {0: np.where(masks[0], 1.0, 0.0).astype(np.float32), 2: np.where(masks[2], -1.0, 0.0).astype(np.float32)}
    objective = make_objective(rules, ctx, table, fresh=True)
    align, prox = objective.terms
    assert isinstance(align, AlignmentTerm) and isinstance(prox, ProximalTerm)
    model = ctx.model
    with torch.no_grad():
        for i, p in enumerate(model.adapter.parameters()):
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(10 + i)) * 0.05)
    assert isinstance(ctx.x, torch.Tensor)  # this test's inputs (a device's may be uint8 images, trainer.Inputs)
    z = model.features(ctx.x[:8])
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0, 2])
    got = objective.loss(z, y, model.head)
    ce = F.cross_entropy(model.head(z), y)
    a = 0.1 * ((z - align.values[y]) ** 2).mean(dim=1).mul(align.present[y].float()).sum() / 8
    shared = shared_parameters(model, "adapter")
    sq = torch.zeros(())
    for w, r in zip(shared, prox.reference, strict=True):
        sq = sq + ((w - r) ** 2).sum()
    pull = 0.2 / 2 * sq
    torch.testing.assert_close(got, ce + a + pull)
    assert pull.item() > 0 and a.item() > 0
    # the proximal part of the gradient is mu (w - w^t): the same gradient without it, plus that
    wants = torch.autograd.grad(ce + a, shared, retain_graph=True)
    for g, want, w, r in zip(torch.autograd.grad(got, shared), wants, shared, prox.reference, strict=True):
        torch.testing.assert_close(g, want + 0.2 * (w.detach() - r), rtol=1e-5, atol=1e-7)


def test_the_agent_pulls_towards_the_adapter_the_round_delivered() -> None:
    cfg = make_config("fedproto", federate="adapter", prox_mu=0.1, **SMALL)
    model = build_model("mlp", cfg.in_shape, cfg.num_classes, cfg.proto_dim, cfg.adapter_rank, seed=cfg.seed)
    broker = InProcessBroker()
    rng = np.random.default_rng(0)
    y = np.repeat([0, 1], 20)
    x = rng.standard_normal((40, 1, 6, 6)).astype(np.float32) + y[:, None, None, None]
    agent = EdgeAgent("dev1", "fp", ClientData(x_train=x, y_train=y, x_test=x[:8], y_test=y[:8]))
    LocalDevice(agent, broker.connect("dev1")).start()
    server = broker.connect("server")
    server.publish(
        topics.config("fp"),
        encode_message(
            Config(preset="fedproto", params=cfg.to_dict(), adapter_layout=model_params.adapter_layout(model)),
            fed="fp",
            sender="server",
        ),
        retain=True,
    )
    broker.pump()
    start = model_params.adapter_vector(model)
    theta = start + np.asarray(rng.standard_normal(start.shape) * 0.1, dtype=np.float32)
    protos, _ = local_prototypes(rng.standard_normal((6, 16)).astype(np.float32), np.arange(6) % 3, 3)
    server.publish(
        topics.round_("fp"),
        encode_message(
            RoundStart(
                deadline=0.0, adapter=theta, targets=ProtoSet.from_table(protos, 16, "f4"), target_label="dense"
            ),
            fed="fp",
            sender="server",
            round=1,
            phase="train",
        ),
        retain=True,
    )
    broker.pump()
    assert agent.stats.rounds_trained == 1
    prox = agent.objective.terms[-1]
    assert isinstance(prox, ProximalTerm) and isinstance(agent.objective.terms[0], AlignmentTerm)
    reference = torch.cat([r.reshape(-1) for r in prox.reference]).numpy()
    assert np.array_equal(reference, theta)  # w^t: the adapter as delivered, not as trained
    assert agent.model is not None
    assert not np.array_equal(model_params.adapter_vector(agent.model), theta)
    assert prox.params[0] is next(agent.model.adapter.parameters())  # the live parameters
