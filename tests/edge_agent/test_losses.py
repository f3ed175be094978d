"""Client-side losses against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from edge_agent.techniques import alignment
from edge_agent.techniques.fedpagr import entropy_regulariser, fedpagr_loss


def test_alignment_is_the_per_element_squared_error_averaged_over_the_batch() -> None:
    z = torch.tensor([[1.0, 2.0], [0.0, 0.0], [5.0, 5.0]])
    y = torch.tensor([0, 1, 2])
    targets = torch.tensor([[0.0, 0.0], [1.0, 1.0], [9.0, 9.0]])
    present = torch.tensor([True, True, False])  # class 2 has no target
    # ||z0 - a0||^2 = 1 + 4 = 5, ||z1 - a1||^2 = 1 + 1 = 2, sample 2 adds 0 but counts in the batch:
    # (1/|B|) sum (1/m) ||z - a||^2 = (5/2 + 2/2 + 0) / 3 = 7/6
    assert alignment(z, y, targets, present).item() == pytest.approx(7 / 6)
    assert alignment(z, y, targets, torch.zeros(3, dtype=torch.bool)).item() == 0.0


def test_alignment_does_not_grow_with_the_prototype_width() -> None:
    # The summed form (RefProtoFL eq. 17) is m times the MSE: at m = 512 it outweighed the
    # cross-entropy 512:1 and training collapsed. The MSE scale of a constant offset is the same
    # whatever m is.
    for m in (2, 512):
        z = torch.full((4, m), 0.5)
        y = torch.tensor([0, 1, 0, 1])
        assert alignment(z, y, torch.zeros(2, m), torch.ones(2, dtype=torch.bool)).item() == pytest.approx(0.25)


def test_alignment_gradient_pulls_z_towards_its_target() -> None:
    z = torch.tensor([[2.0, 0.0]], requires_grad=True)
    alignment(z, torch.tensor([0]), torch.tensor([[0.0, 0.0]]), torch.tensor([True])).backward()
    # d/dz (1/1)(1/2)((z0)^2 + z1^2) = (z0, z1) = (2, 0)
    assert z.grad is not None and z.grad.tolist() == [[2.0, 0.0]]


def test_entropy_regulariser_hand_example() -> None:
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    # row 0: softmax (1/2, 1/2) -> mean log = log 1/2 ; row 1: (3/4, 1/4) -> (log 3/4 + log 1/4)/2
    expected = -((math.log(0.5)) + (math.log(0.75) + math.log(0.25)) / 2) / 2
    assert entropy_regulariser(logits).item() == pytest.approx(expected)


def test_fedpagr_loss_hand_example() -> None:
    # z normalises to e0 and e1; P = identity rows; head anchored to P with zero bias.
    z = torch.tensor([[2.0, 0.0], [0.0, 3.0]])
    y = torch.tensor([0, 1])
    P = torch.eye(2)
    head = torch.nn.Linear(2, 2)
    with torch.no_grad():
        head.weight.copy_(P)
        head.bias.zero_()
    beta, lam = 0.5, 0.1
    # head(z_hat) logits: [1, 0] and [0, 1]: CE = log(1 + e^-1) each
    ce_head = math.log(1 + math.exp(-1))
    # prototype logits / beta: [2, 0] and [0, 2]: CE = log(1 + e^-2) each
    ce_proto = math.log(1 + math.exp(-2))
    # L_ent per row: -(log softmax_0 + log softmax_1)/2 with logits [2, 0]
    ls = [2 - math.log(math.exp(2) + 1), 0 - math.log(math.exp(2) + 1)]
    ent = -(ls[0] + ls[1]) / 2
    expected = ce_head + ce_proto + lam * ent
    assert fedpagr_loss(z, y, head, P, beta, lam).item() == pytest.approx(expected, rel=1e-6)


def _loss_and_grads(loss_of, z: torch.Tensor, head: torch.nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    z = z.detach().clone().requires_grad_()
    loss = loss_of(z)
    return loss, list(torch.autograd.grad(loss, [z, *head.parameters()]))


def test_composed_objectives_are_the_single_losses_bit_for_bit() -> None:
    # The objective is the classifier's loss plus each rule's terms, added in order: the same operations in the
    # same order as the one loss each technique had before (golden reports, bytes and accuracies, did not move).
    from edge_agent.techniques import AlignmentTerm, NearestTargetClassifier, Objective
    from edge_agent.techniques.fedpagr import pagr_objective

    g = torch.Generator().manual_seed(0)
    z, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
    head = torch.nn.Linear(8, 3)
    targets = {0: torch.randn(8, generator=g).numpy(), 2: torch.randn(8, generator=g).numpy()}
    align = AlignmentTerm(targets, 3, 8, 0.3)
    objective = Objective(NearestTargetClassifier(targets), (align,), targets)
    got = _loss_and_grads(lambda z: objective.loss(z, y, head), z, head)
    want = _loss_and_grads(
        lambda z: torch.nn.functional.cross_entropy(head(z), y) + 0.3 * alignment(z, y, align.values, align.present),
        z,
        head,
    )
    assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True))
    P = torch.nn.functional.normalize(torch.randn(3, 8, generator=g), dim=1)
    pagr = pagr_objective(P, 0.1, 0.1, train_head=True, cosine=True)
    got = _loss_and_grads(lambda z: pagr.loss(z, y, head), z, head)
    want = _loss_and_grads(lambda z: fedpagr_loss(z, y, head, P, 0.1, 0.1), z, head)
    assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True))
    assert Objective().loss(z, y, head).item() == torch.nn.functional.cross_entropy(head(z), y).item()
