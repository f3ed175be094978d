"""APUD (RefProtoFL Alg. 1-2): budgets, Top-K selection, masked aggregation; hand-computed."""

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protofl.algorithms.apud import ApudAggregator, budget_from_bytes, select_topk, topk_budget
from protofl.sparse import SparseVector


@pytest.mark.parametrize(
    "d, ratio, k",
    [
        (100_000, 0.1, 10_000),
        (30, 0.1, 3),  # 0.1 * 30 = 3.0000000000000004 in binary; must not round up to 4
        (10, 0.05, 1),  # ceil(0.5) = 1
        (10, 0.25, 3),  # ceil(2.5) = 3
        (7, 1e-9, 1),  # clipped up to 1
        (10, 2.0, 10),  # clipped down to d
        (10, 1.0, 10),
    ],
)
def test_topk_budget(d, ratio, k):
    assert topk_budget(d, ratio) == k


@pytest.mark.parametrize("ratio", [0.0, -0.1, float("nan"), float("inf")])
def test_topk_budget_rejects(ratio):
    with pytest.raises(ValueError):
        topk_budget(10, ratio)


@pytest.mark.parametrize(
    "d, budget, value_bytes, k",
    [
        (1000, 60, 4, 10),  # u2 index + f4 value = 6 bytes a pair: 60 // 6 = 10
        (100_000, 60, 4, 7),  # u4 index + f4 value = 8 bytes: 60 // 8 = 7
        (1000, 60, 2, 15),  # u2 + f2 = 4 bytes: 15
        (65_535, 60, 4, 10),  # last length with 2-byte indices
        (65_536, 60, 4, 7),  # first length with 4-byte indices
        (1000, 0, 4, 1),  # clipped up to 1
        (1000, 10**9, 4, 1000),  # clipped down to d
        # above 1/16 density (u2) the packed mask (ceil(d/8) bytes) is cheaper than indices:
        (1000, 2125, 4, 500),  # mask 125 B + 500 * 4 = 2125 (indices would fit only 2125 // 6 = 354)
        (1000, 2124, 4, 499),  # one byte short of 500 values
        (100_000, 52_500, 4, 10_000),  # mask 12,500 B + 10,000 f4 values (indices: 52,500 // 8 = 6,562)
        (1000, 624, 4, 124),  # 624 - 125 = 499 // 4 = 124 by mask; 624 // 6 = 104 by index
        (1000, 120, 4, 20),  # budget below the mask's size: indices only, 120 // 6 = 20
    ],
)
def test_budget_from_bytes(d, budget, value_bytes, k):
    assert budget_from_bytes(d, budget, value_bytes) == k


def test_select_topk_hand_example():
    local = np.array([0.5, -1.0, 2.0, 0.1, 3.0], dtype=np.float32)
    glob = np.array([0.0, 0.0, 0.0, 0.0, 3.5], dtype=np.float32)
    # u = |local - global| = [0.5, 1.0, 2.0, 0.1, 0.5]
    sv = select_topk(local, glob, 2)
    # two largest: 2.0 (index 2) and 1.0 (index 1); sorted ascending; the VALUES are sent, not deltas
    assert sv.n == 5
    np.testing.assert_array_equal(sv.indices, [1, 2])
    np.testing.assert_array_equal(sv.values, [-1.0, 2.0])
    assert sv.indices.dtype == np.int64 and sv.values.dtype == np.float32
    sv = select_topk(local, glob, 3)
    # third place: indices 0 and 4 tie at 0.5 -> the lower index (0) wins
    np.testing.assert_array_equal(sv.indices, [0, 1, 2])
    np.testing.assert_array_equal(sv.values, [0.5, -1.0, 2.0])


def test_select_topk_all_ties_takes_lowest_indices():
    glob = np.zeros(8, dtype=np.float32)
    local = np.array([1, -1, 1, -1, 1, -1, 1, -1], dtype=np.float32)  # every |u| = 1
    np.testing.assert_array_equal(select_topk(local, glob, 3).indices, [0, 1, 2])
    # deterministic across calls
    np.testing.assert_array_equal(select_topk(local, glob, 3).indices, select_topk(local, glob, 3).indices)


def test_select_topk_k_equals_d_sends_everything():
    local = np.array([3.0, 1.0, 2.0], dtype=np.float32)
    sv = select_topk(local, np.zeros(3, dtype=np.float32), 3)
    np.testing.assert_array_equal(sv.indices, [0, 1, 2])
    np.testing.assert_array_equal(sv.values, local)


@pytest.mark.parametrize(
    "local, glob, k",
    [
        (np.ones(4), np.ones(4), 0),
        (np.ones(4), np.ones(4), 5),
        (np.ones(4), np.ones(3), 1),
        (np.array([1.0, np.nan, 0.0]), np.zeros(3), 1),
        (np.ones((2, 2)), np.ones((2, 2)), 1),
    ],
)
def test_select_topk_rejects(local, glob, k):
    with pytest.raises(ValueError):
        select_topk(local, glob, k)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-3, 3), min_size=1, max_size=40), st.data())
def test_select_topk_matches_brute_force(values, data):
    # small integers -> many ties, which is where a selection can go wrong
    local = np.array(values, dtype=np.float32)
    glob = np.zeros_like(local)
    k = data.draw(st.integers(1, len(values)))
    u = np.abs(local)
    expected = sorted(sorted(range(len(values)), key=lambda i: (-u[i], i))[:k])
    np.testing.assert_array_equal(select_topk(local, glob, k).indices, expected)


def test_select_topk_is_fast_for_large_d():
    rng = np.random.default_rng(0)
    d = 100_000
    glob = rng.standard_normal(d).astype(np.float32)
    local = glob + rng.standard_normal(d).astype(np.float32)
    t0 = time.perf_counter()
    sv = select_topk(local, glob, 10_000)
    assert time.perf_counter() - t0 < 1.0  # ~2 ms in practice; 1 s only catches an O(d log d) python loop
    assert sv.nnz == 10_000


def _sv(n, idx, vals):
    return SparseVector(n=n, indices=np.array(idx, dtype=np.int64), values=np.array(vals, dtype=np.float32))


def test_aggregation_hand_example_alg2():
    theta = np.array([10.0, 20.0, 30.0, 40.0, 50.0], dtype=np.float32)
    agg = ApudAggregator(theta)
    agg.add(_sv(5, [0, 1], [1.0, 2.0]), weight=1)  # client A, |D_A| = 1
    agg.add(_sv(5, [1, 2], [6.0, 9.0]), weight=3)  # client B, |D_B| = 3
    agg.add(_sv(5, [0], [5.0]), weight=4)  # client C, |D_C| = 4
    # i=0: A and C sent it: (1*1 + 4*5) / (1 + 4) = 21/5 = 4.2
    # i=1: A and B:         (1*2 + 3*6) / (1 + 3) = 20/4 = 5.0
    # i=2: B only:          9.0
    # i=3, i=4: nobody sent them -> keep theta_global: 40, 50
    out = agg.result()
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, [4.2, 5.0, 9.0, 40.0, 50.0], rtol=1e-7)
    assert agg.senders == 3


def test_nothing_added_returns_theta_global():
    theta = np.array([1.5, -2.0], dtype=np.float32)
    np.testing.assert_array_equal(ApudAggregator(theta).result(), theta)


def test_dense_update_counts_as_every_index_sent():
    agg = ApudAggregator(np.array([1.0, 1.0], dtype=np.float32))
    agg.add(np.array([3.0, 5.0], dtype=np.float32), 1)  # full adapter
    agg.add(_sv(2, [0], [7.0]), 1)
    # i=0: (3 + 7) / 2 = 5; i=1: only the dense client: 5
    np.testing.assert_array_equal(agg.result(), [5.0, 5.0])


def test_single_client_full_topk_reproduces_its_adapter():
    rng = np.random.default_rng(1)
    glob = rng.standard_normal(50).astype(np.float32)
    local = rng.standard_normal(50).astype(np.float32)
    agg = ApudAggregator(glob)
    agg.add(select_topk(local, glob, 10), 123)
    out = agg.result()
    sent = select_topk(local, glob, 10).indices
    np.testing.assert_array_equal(out[sent], local[sent])
    rest = np.setdiff1d(np.arange(50), sent)
    np.testing.assert_array_equal(out[rest], glob[rest])


@pytest.mark.parametrize(
    "update, weight",
    [
        (_sv(6, [0], [1.0]), 1),  # n mismatch
        (_sv(5, [0], [1.0]), 0),
        (_sv(5, [0], [1.0]), -1),
        (_sv(5, [0], [1.0]), float("inf")),
        (_sv(5, [0, 1], [1.0, np.nan]), 1),
        (_sv(5, [2, 1], [1.0, 1.0]), 1),  # unsorted
        (_sv(5, [1, 1], [1.0, 1.0]), 1),  # duplicate
        (_sv(5, [5], [1.0]), 1),  # out of range
        (_sv(5, [-1, 2], [1.0, 1.0]), 1),
        (np.ones(4, dtype=np.float32), 1),  # dense, wrong length
        (np.array([1.0, 1.0, np.inf, 1.0, 1.0]), 1),
    ],
)
def test_bad_upload_rejected_and_state_unchanged(update, weight):
    theta = np.arange(5, dtype=np.float32)
    agg = ApudAggregator(theta)
    agg.add(_sv(5, [3], [9.0]), 2)
    before = agg.result()
    with pytest.raises(ValueError):
        agg.add(update, weight)
    assert agg.senders == 1
    np.testing.assert_array_equal(agg.result(), before)


def test_empty_sparse_update_changes_nothing_but_count():
    theta = np.arange(3, dtype=np.float32)
    agg = ApudAggregator(theta)
    agg.add(_sv(3, [], []), 5)
    assert agg.senders == 1
    np.testing.assert_array_equal(agg.result(), theta)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 30), st.integers(1, 6), st.integers(0, 2**32 - 1))
def test_matches_dense_reference(d, clients, seed):
    rng = np.random.default_rng(seed)
    glob = rng.standard_normal(d).astype(np.float32)
    agg = ApudAggregator(glob)
    masks, thetas, weights = [], [], []
    for _ in range(clients):
        theta = rng.standard_normal(d).astype(np.float32)
        k = int(rng.integers(1, d + 1))
        sv = select_topk(theta, glob, k)
        w = int(rng.integers(1, 1000))
        agg.add(sv, w)
        mask = np.zeros(d, bool)
        mask[sv.indices] = True
        masks.append(mask)
        thetas.append(theta.astype(np.float64))
        weights.append(w)
    M, T, W = np.array(masks), np.array(thetas), np.array(weights, dtype=np.float64)[:, None]
    den = (M * W).sum(0)
    expected = np.where(den > 0, (M * W * T).sum(0) / np.where(den > 0, den, 1), glob)
    np.testing.assert_allclose(agg.result(), expected.astype(np.float32), rtol=1e-6, atol=1e-6)


def test_accepts_wire_dtypes_u2_indices_and_f2_values():
    agg = ApudAggregator(np.zeros(4, dtype=np.float32))
    agg.add(SparseVector(n=4, indices=np.array([1, 3], dtype=np.uint16), values=np.array([0.5, 2.0], np.float16)), 2)
    np.testing.assert_array_equal(agg.result(), [0.0, 0.5, 0.0, 2.0])


@pytest.mark.parametrize("d", [100, 1000, 40_000, 70_000])
@pytest.mark.parametrize("budget", [64, 500, 3000, 20_000, 60_000])
def test_budget_from_bytes_fills_the_encoded_arrays_without_overflow(d, budget):
    from protofl.wire.codec import encode_sparse

    k = budget_from_bytes(d, budget)
    rng = np.random.default_rng(d + budget)
    sv = select_topk(rng.standard_normal(d).astype(np.float32), np.zeros(d, np.float32), k)
    enc = encode_sparse(sv)
    positions = enc["i"] if "i" in enc else enc["mask"]
    used = len(enc["v"]["b"]) + len(positions["b"])
    if k > 1 and k < d:
        assert used <= budget  # what the codec sends fits
        sv2 = select_topk(rng.standard_normal(d).astype(np.float32), np.zeros(d, np.float32), k + 1)
        enc2 = encode_sparse(sv2)
        pos2 = enc2["i"] if "i" in enc2 else enc2["mask"]
        assert len(enc2["v"]["b"]) + len(pos2["b"]) > budget  # and one more pair would not
