"""Client-side losses against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from edge_agent import losses


def test_fedproto_mse_only_on_samples_with_a_target() -> None:
    z = torch.tensor([[1.0, 2.0], [0.0, 0.0], [5.0, 5.0]])
    y = torch.tensor([0, 1, 2])
    targets = torch.tensor([[0.0, 0.0], [1.0, 1.0], [9.0, 9.0]])
    present = torch.tensor([True, True, False])  # class 2 has no global prototype
    # sample 0: (1^2 + 2^2) = 5 ; sample 1: (1 + 1) = 2 ; mean over 2 samples x 2 dims = 7/4
    assert losses.fedproto_mse(z, y, targets, present).item() == pytest.approx(7 / 4)
    assert losses.fedproto_mse(z, y, targets, torch.zeros(3, dtype=torch.bool)).item() == 0.0


def test_anchor_alignment_is_squared_l2_averaged_over_the_batch() -> None:
    z = torch.tensor([[1.0, 2.0], [0.0, 0.0], [5.0, 5.0]])
    y = torch.tensor([0, 1, 2])
    anchors = torch.tensor([[0.0, 0.0], [1.0, 1.0], [9.0, 9.0]])
    present = torch.tensor([True, True, False])
    # ||z0 - a0||^2 = 5, ||z1 - a1||^2 = 2, sample 2 has no anchor -> (5 + 2 + 0) / 3
    assert losses.anchor_alignment(z, y, anchors, present).item() == pytest.approx(7 / 3)


def test_entropy_regulariser_hand_example() -> None:
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    # row 0: softmax (1/2, 1/2) -> mean log = log 1/2 ; row 1: (3/4, 1/4) -> (log 3/4 + log 1/4)/2
    expected = -((math.log(0.5)) + (math.log(0.75) + math.log(0.25)) / 2) / 2
    assert losses.entropy_regulariser(logits).item() == pytest.approx(expected)


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
    assert losses.fedpagr_loss(z, y, head, P, beta, lam).item() == pytest.approx(expected, rel=1e-6)
