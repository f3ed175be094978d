"""FedPAGR (eqs. 3-6): consensus aggregation, refinement loss, hand gradient, refinement; hand-computed."""

import math

import numpy as np
import pytest

from protofl.algorithms.fedpagr import geometric_refine, refine_anchor_table, refinement_loss_and_grad
from protofl.algorithms.unit import ConsensusAggregator, initial_prototypes, normalize_rows

A = np.array
R2 = math.sqrt(2.0)


def test_normalize_rows_hand_example():
    out = normalize_rows(A([[3.0, 4.0], [0.0, 0.0]]))
    # [3, 4] / 5 = [0.6, 0.8]; a zero row stays zero (norm clamped to eps)
    np.testing.assert_allclose(out, [[0.6, 0.8], [0.0, 0.0]])
    assert normalize_rows(A([3.0, 4.0], dtype=np.float32)).dtype == np.float32
    np.testing.assert_allclose(normalize_rows(A([0, 5])), [0.0, 1.0])


def test_initial_prototypes_seeded_unit_rows():
    p = initial_prototypes(10, 16, seed=3)
    assert p.shape == (10, 16) and p.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(p, axis=1), 1.0, rtol=1e-6)
    np.testing.assert_array_equal(p, initial_prototypes(10, 16, seed=3))
    assert not np.array_equal(p, initial_prototypes(10, 16, seed=4))


def test_consensus_hand_example():
    previous = A([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    agg = ConsensusAggregator(previous)
    agg.add({0: A([1.0, 0.0]), 1: A([0.0, 2.0])})  # [0, 2] is not unit: normalised to [0, 1]
    agg.add({0: A([0.0, 1.0])})
    S, K = agg.sums()
    np.testing.assert_allclose(S, [[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]])
    np.testing.assert_array_equal(K, [2, 1, 0])
    p = agg.result()
    # class 0: normalize(([1, 0] + [0, 1]) / 2) = [1/sqrt2, 1/sqrt2]; class 1: [0, 1]
    # class 2: nobody sent it -> last round's row [1, 0]
    np.testing.assert_allclose(p, [[1 / R2, 1 / R2], [0.0, 1.0], [1.0, 0.0]], rtol=1e-6)
    assert p.dtype == np.float32
    assert agg.senders == 2


def test_consensus_nothing_sent_keeps_previous_and_cancelling_class_too():
    previous = initial_prototypes(2, 3, seed=0)
    agg = ConsensusAggregator(previous)
    np.testing.assert_array_equal(agg.result(), previous)
    agg.add({1: A([1.0, 0.0, 0.0])})
    agg.add({1: A([-1.0, 0.0, 0.0])})  # the two submissions cancel: no mean direction
    np.testing.assert_array_equal(agg.result(), previous)


@pytest.mark.parametrize(
    "protos",
    [
        {0: A([0.0, 0.0])},  # zero vector has no direction
        {0: A([np.nan, 1.0])},
        {2: A([1.0, 0.0])},  # class out of range
        {0: A([1.0, 0.0, 0.0])},
        {0: A([1.0, 0.0]), 1: A([np.inf, 0.0])},  # one bad class spoils the upload
    ],
)
def test_consensus_rejects_and_state_unchanged(protos):
    agg = ConsensusAggregator(A([[1.0, 0.0], [0.0, 1.0]]))
    agg.add({0: A([0.0, 1.0])})
    with pytest.raises(ValueError):
        agg.add(protos)
    S, K = agg.sums()
    np.testing.assert_array_equal(S, [[0.0, 1.0], [0.0, 0.0]])
    np.testing.assert_array_equal(K, [1, 0])
    assert agg.senders == 1


def test_loss_and_grad_hand_example():
    P = A([[1.0, 0.0], [1.0, 1.0]])  # P_hat = [[1, 0], [1/sqrt2, 1/sqrt2]]
    S = A([[1.0, 0.0], [0.0, 2.0]])
    K = A([1.0, 2.0])
    loss, grad = refinement_loss_and_grad(P, S, K, lambda_s=0.5, margin=0.3)
    # agreement: (1 - [1,0].[1,0]) + (2 - [0,2].[1,1]/sqrt2) = 0 + 2 - sqrt2
    # separation: cos = 1/sqrt2 > 0.3 for both ordered pairs (0,1), (1,0): 0.5 * 2 * (1/sqrt2 - 0.3)
    # total: 2 - sqrt2 + 1/sqrt2 - 0.3 = 1.7 - 1/sqrt2
    assert loss == pytest.approx(1.7 - 1 / R2, rel=1e-12)
    # row 0: dL/dP_hat_0 = -S_0 + 2*0.5*P_hat_1 = [1/sqrt2 - 1, 1/sqrt2]; removing the part along
    # P_hat_0 = [1, 0] leaves [0, 1/sqrt2]; ||P_0|| = 1
    np.testing.assert_allclose(grad[0], [0.0, 1 / R2], atol=1e-15)
    # row 1: dL/dP_hat_1 = -[0, 2] + [1, 0] = [1, -2]; radial part (1 - 2)/sqrt2 * P_hat_1 = [-0.5, -0.5];
    # tangential [1.5, -1.5]; divided by ||P_1|| = sqrt2 -> [1.5/sqrt2, -1.5/sqrt2]
    np.testing.assert_allclose(grad[1], [1.5 / R2, -1.5 / R2], rtol=1e-12)


def test_separation_counts_ordered_pairs():
    # two identical classes, no submissions: cos = 1, sum over c != c' sees the pair twice:
    # lambda * 2 * (1 - 0.3) = 1 * 1.4
    P = A([[1.0, 0.0], [2.0, 0.0]])
    loss, _ = refinement_loss_and_grad(P, np.zeros((2, 2)), np.zeros(2), lambda_s=1.0, margin=0.3)
    assert loss == pytest.approx(1.4)


def test_pairs_below_margin_cost_nothing():
    P = np.eye(3)  # all cosines 0 < margin
    S = np.eye(3)
    loss, grad = refinement_loss_and_grad(P, S, np.ones(3))
    assert loss == pytest.approx(0.0)  # each agreement term 1 - 1 = 0, no separation
    np.testing.assert_allclose(grad, 0.0, atol=1e-15)


def test_gradient_matches_central_differences():
    rng = np.random.default_rng(0)
    C, m = 6, 5
    # three rows share a common direction so that their pairs sit above the margin, the rest do not
    P = rng.standard_normal((C, m))
    P[:3] += 2.0 * rng.standard_normal(m)
    S = 2.0 * rng.standard_normal((C, m))
    K = rng.integers(0, 4, C).astype(np.float64)
    lam, margin = 0.5, 0.3
    Ph = normalize_rows(P)
    excess = (Ph @ Ph.T - margin)[~np.eye(C, dtype=bool)]
    assert (excess > 0).sum() >= 4 and (excess < 0).sum() >= 4  # both hinge branches exercised
    assert np.abs(excess).min() > 1e-3  # no kink within reach of the finite-difference step
    loss, grad = refinement_loss_and_grad(P, S, K, lam, margin)
    h = 1e-6
    fd = np.zeros_like(P)
    for idx in np.ndindex(P.shape):
        e = np.zeros_like(P)
        e[idx] = h
        up = refinement_loss_and_grad(P + e, S, K, lam, margin)[0]
        down = refinement_loss_and_grad(P - e, S, K, lam, margin)[0]
        fd[idx] = (up - down) / (2 * h)
    np.testing.assert_allclose(grad, fd, rtol=1e-5, atol=1e-8)
    assert grad.dtype == np.float64


def test_loss_rejects_zero_rows_and_bad_shapes():
    with pytest.raises(ValueError, match="zero"):
        refinement_loss_and_grad(A([[0.0, 0.0], [1.0, 0.0]]), np.zeros((2, 2)), np.zeros(2))
    with pytest.raises(ValueError):
        refinement_loss_and_grad(np.ones((2, 2)), np.zeros((2, 3)), np.zeros(2))


def test_geometric_refine_one_step_by_hand():
    P0 = A([[1.0, 0.0], [1.0, 1.0]])
    S = A([[1.0, 0.0], [0.0, 2.0]])
    K = A([1.0, 2.0])
    out = geometric_refine(P0, S, K, steps=1, lr=0.1)
    # one step: P_1 = P_0 - 0.1 * grad (v = grad on the first step), grad from the hand example above
    expected = normalize_rows(P0 - 0.1 * A([[0.0, 1 / R2], [1.5 / R2, -1.5 / R2]]))
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    assert out.dtype == np.float32


def test_geometric_refine_momentum_is_torch_style():
    rng = np.random.default_rng(0)
    P0, S, K = rng.standard_normal((4, 3)), rng.standard_normal((4, 3)), np.ones(4)
    # v1 = g(P0); P1 = P0 - lr v1; v2 = 0.9 v1 + g(P1); P2 = P1 - lr v2
    g0 = refinement_loss_and_grad(P0, S, K)[1]
    P1 = P0 - 0.01 * g0
    v2 = 0.9 * g0 + refinement_loss_and_grad(P1, S, K)[1]
    P2 = P1 - 0.01 * v2
    np.testing.assert_allclose(geometric_refine(P0, S, K, steps=2), normalize_rows(P2), rtol=1e-6)


def test_geometric_refine_matches_torch_sgd():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    C, m = 5, 4
    P0 = rng.standard_normal((1, m)) + 0.7 * rng.standard_normal((C, m))
    S = rng.standard_normal((C, m))
    K = rng.integers(0, 3, C).astype(np.float64)
    Pt = torch.tensor(P0, requires_grad=True)
    opt = torch.optim.SGD([Pt], lr=0.05, momentum=0.9)
    off = ~torch.eye(C, dtype=torch.bool)
    for _ in range(7):
        opt.zero_grad()
        Ph = Pt / Pt.norm(dim=1, keepdim=True)
        loss = (torch.tensor(K).sum() - (torch.tensor(S) * Ph).sum()) + 0.5 * torch.relu(Ph @ Ph.T - 0.3)[off].sum()
        loss.backward()
        opt.step()
    ref = (Pt / Pt.norm(dim=1, keepdim=True)).detach().numpy()
    np.testing.assert_allclose(geometric_refine(P0, S, K, steps=7, lr=0.05), ref, rtol=1e-5, atol=1e-6)


def test_geometric_refine_steps_zero_only_projects_and_separation_separates():
    P0 = A([[1.0, 0.1], [1.0, -0.1]]) * 3.0
    no_data = (np.zeros((2, 2)), np.zeros(2))
    np.testing.assert_allclose(geometric_refine(P0, *no_data, steps=0), normalize_rows(P0), rtol=1e-6)
    out = geometric_refine(P0, *no_data, steps=5, lr=0.1, lambda_s=1.0)
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, rtol=1e-6)
    before = float(normalize_rows(P0)[0] @ normalize_rows(P0)[1])
    assert float(out[0] @ out[1]) < before


def test_geometric_refine_rejects_bad_hyperparameters():
    P = np.eye(2)
    for kw in ({"steps": -1}, {"lr": float("nan")}, {"momentum": 1.0}, {"lambda_s": -0.1}):
        with pytest.raises(ValueError):
            geometric_refine(P, P, np.ones(2), **kw)


def test_refine_anchor_table_disjoint_masks_is_a_no_op():
    # disjoint supports make the anchors orthogonal: no separation term is active, and agreement
    # is already at its optimum, so refinement must hand the anchors back unchanged
    masks = np.array([[1, 1, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 1, 1]], dtype=bool)
    anchors = {0: A([3.0, 4.0, 0, 0, 0, 0]), 2: A([0, 0, 0, 0, -1.0, 2.0])}
    out = refine_anchor_table(anchors, masks)
    assert sorted(out) == [0, 2]  # class 1 absent stays absent
    for c in anchors:
        np.testing.assert_allclose(out[c], anchors[c], rtol=1e-6, atol=1e-7)
        assert out[c].dtype == np.float32


def test_refine_anchor_table_overlapping_masks():
    masks = np.array([[1, 1, 1, 0], [0, 1, 1, 1]], dtype=bool)
    # off-support energy in anchor 0 (dim 3) is cut before refining
    anchors = {0: A([1.0, 2.0, 2.0, 0.5]), 1: A([0.0, 4.0, 4.0, 2.0])}
    out = refine_anchor_table(anchors, masks, steps=5, lr=0.1, lambda_s=1.0)
    # off-support dims are zero again
    assert out[0][3] == 0.0 and out[1][0] == 0.0
    # the original norms are restored: ||[1, 2, 2, 0.5]|| = sqrt(9.25), ||[0, 4, 4, 2]|| = 6
    assert np.linalg.norm(out[0]) == pytest.approx(math.sqrt(9.25), rel=1e-6)
    assert np.linalg.norm(out[1]) == pytest.approx(6.0, rel=1e-6)
    # and the two classes have moved apart
    unit = lambda v: v / np.linalg.norm(v)  # noqa: E731
    before = unit(np.where(masks[0], anchors[0], 0)) @ unit(anchors[1])
    assert unit(out[0]) @ unit(out[1]) < before


def test_refine_anchor_table_without_masks_and_edges():
    assert refine_anchor_table({}) == {}
    out = refine_anchor_table({5: A([0.0, 2.0])})
    np.testing.assert_allclose(out[5], [0.0, 2.0], rtol=1e-6)  # single class: nothing to separate from
    # an anchor that is zero on its support has no direction: returned unchanged
    masks = np.array([[True, False], [False, True]])
    out = refine_anchor_table({0: A([0.0, 1.0]), 1: A([0.0, 3.0])}, masks)
    np.testing.assert_array_equal(out[0], [0.0, 1.0])
    np.testing.assert_allclose(out[1], [0.0, 3.0], rtol=1e-6)
    with pytest.raises(ValueError, match="no mask"):
        refine_anchor_table({2: A([1.0, 0.0])}, masks)
