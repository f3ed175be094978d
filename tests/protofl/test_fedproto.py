"""FedProto: local prototypes, weighted / mean aggregation, nearest prototype; hand-computed."""

import numpy as np
import pytest

from protofl.algorithms.fedproto import PrototypeAggregator
from protofl.algorithms.prototypes import local_prototypes, nearest_prototype


def test_local_prototypes_hand_example():
    z = np.array([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0]], dtype=np.float32)
    y = np.array([0, 0, 2])
    protos, counts = local_prototypes(z, y, num_classes=3)
    # class 0: mean of [1, 0] and [3, 0] = [2, 0]; class 2: [0, 2]; class 1 absent -> not sent
    assert sorted(protos) == [0, 2]
    np.testing.assert_array_equal(protos[0], [2.0, 0.0])
    np.testing.assert_array_equal(protos[2], [0.0, 2.0])
    assert counts == {0: 2, 2: 1}
    assert protos[0].dtype == np.float32


def test_local_prototypes_empty_input():
    assert local_prototypes(np.zeros((0, 4)), np.zeros(0, dtype=np.int64), 3) == ({}, {})


@pytest.mark.parametrize(
    "z, y",
    [
        (np.zeros((2, 2)), np.array([0, 3])),  # label out of range
        (np.zeros((2, 2)), np.array([0, -1])),
        (np.array([[np.nan, 0.0], [0.0, 0.0]]), np.array([0, 1])),
        (np.zeros((3, 2)), np.array([0, 1])),  # length mismatch
        (np.zeros((2, 2)), np.array([0.0, 1.0])),  # float labels
    ],
)
def test_local_prototypes_rejects(z, y):
    with pytest.raises(ValueError):
        local_prototypes(z, y, 3)


def _two_clients(weighting):
    agg = PrototypeAggregator(num_classes=3, dim=2, weighting=weighting)
    agg.add({0: np.array([1.0, 1.0]), 1: np.array([2.0, 0.0])}, {0: 1, 1: 2})
    agg.add({0: np.array([4.0, 4.0])}, {0: 3})
    return agg


def test_weighted_aggregation_hand_example():
    g = _two_clients("weighted").result()
    # g_0 = (1*[1, 1] + 3*[4, 4]) / (1 + 3) = [13, 13] / 4 = [3.25, 3.25]
    np.testing.assert_array_equal(g[0], [3.25, 3.25])
    # g_1: only the first client sent it -> its own prototype
    np.testing.assert_array_equal(g[1], [2.0, 0.0])
    # class 2: nobody sent it -> absent, not a zero vector
    assert 2 not in g
    assert g[0].dtype == np.float32


def test_mean_aggregation_hand_example():
    agg = _two_clients("mean")
    g = agg.result()
    # g_0 = ([1, 1] + [4, 4]) / 2 = [2.5, 2.5]; counts are ignored
    np.testing.assert_array_equal(g[0], [2.5, 2.5])
    np.testing.assert_array_equal(g[1], [2.0, 0.0])
    assert agg.senders == 2


def test_mean_aggregation_needs_no_counts():
    agg = PrototypeAggregator(2, 1, weighting="mean")
    agg.add({1: np.array([3.0])}, None)
    agg.add({1: np.array([5.0])})
    assert agg.result() == {1: np.array([4.0], dtype=np.float32)}


def test_nothing_sent_gives_empty_table_and_empty_upload_counts_as_sender():
    agg = PrototypeAggregator(3, 2)
    assert agg.result() == {}
    agg.add({}, {})
    assert agg.senders == 1 and agg.result() == {}


@pytest.mark.parametrize(
    "protos, counts",
    [
        ({0: np.array([1.0, 1.0])}, None),  # weighted needs counts
        ({0: np.array([1.0, 1.0])}, {}),  # count missing for class 0
        ({0: np.array([1.0, 1.0])}, {0: 0}),
        ({0: np.array([1.0, 1.0])}, {0: 2.5}),
        ({0: np.array([1.0, 1.0])}, {0: True}),
        ({3: np.array([1.0, 1.0])}, {3: 1}),  # class out of range
        ({0: np.array([1.0, 1.0, 1.0])}, {0: 1}),  # wrong dim
        ({0: np.array([1.0, 1.0]), 1: np.array([np.nan, 0.0])}, {0: 1, 1: 1}),  # one bad class spoils all
    ],
)
def test_rejected_upload_leaves_state_unchanged(protos, counts):
    agg = PrototypeAggregator(3, 2)
    agg.add({0: np.array([2.0, 2.0])}, {0: 1})
    with pytest.raises(ValueError):
        agg.add(protos, counts)
    assert agg.senders == 1
    assert list(agg.result()) == [0]
    np.testing.assert_array_equal(agg.result()[0], [2.0, 2.0])


def test_unknown_weighting():
    with pytest.raises(ValueError, match="weighting"):
        PrototypeAggregator(3, 2, weighting="median")


def test_nearest_prototype_hand_example_with_tie():
    # inserted out of order on purpose: the tie-break must not depend on dict order
    protos = {2: np.array([4.0, 0.0]), 0: np.array([0.0, 0.0])}
    z = np.array([[1.0, 0.0], [3.0, 0.0], [2.0, 0.0]])
    # [1, 0]: distance 1 to class 0, 3 to class 2 -> 0
    # [3, 0]: 3 vs 1 -> 2
    # [2, 0]: 2 vs 2, a tie -> the lower class id, 0
    np.testing.assert_array_equal(nearest_prototype(z, protos), [0, 2, 0])


def test_nearest_prototype_edges():
    assert nearest_prototype(np.zeros((0, 2)), {0: np.zeros(2)}).shape == (0,)
    with pytest.raises(ValueError, match="empty"):
        nearest_prototype(np.zeros((1, 2)), {})
    with pytest.raises(ValueError):
        nearest_prototype(np.zeros((1, 3)), {0: np.zeros(2)})


def test_nearest_prototype_matches_brute_force():
    rng = np.random.default_rng(0)
    z = rng.standard_normal((50, 6))
    protos = {c: rng.standard_normal(6) for c in (1, 4, 7)}
    classes = np.array([1, 4, 7])
    brute = classes[np.argmin(((z[:, None, :] - np.stack([protos[c] for c in classes])[None]) ** 2).sum(-1), axis=1)]
    np.testing.assert_array_equal(nearest_prototype(z, protos), brute)
