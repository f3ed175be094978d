"""ERPA (RefProtoFL Alg. 4, eqs. 14-16): external / global prototypes and anchors; hand-computed."""

import numpy as np
import pytest

from protofl.algorithms.erpa import ErpaAggregator, combine_anchors, unit_anchors

A = np.array


def _hand_example():
    # 5 classes, dim 2; classes 0 and 1 are public-covered, 2..4 are not
    agg = ErpaAggregator(num_classes=5, dim=2, public_classes=[0, 1])
    agg.add(public={0: A([1.0, 0.0]), 1: A([0.0, 2.0])}, local={2: A([2.0, 2.0])}, local_counts={2: 1})
    agg.add(
        public={0: A([3.0, 0.0]), 1: A([0.0, 4.0])},
        local={2: A([6.0, 6.0]), 3: A([1.0, 1.0])},
        local_counts={2: 3, 3: 5},
    )
    # third client's public prototype for class 1 was lost; it has no uncovered classes
    agg.add(public={0: A([5.0, 3.0])}, local={}, local_counts={})
    return agg


def test_ext_is_uniform_mean_over_senders():
    ext = _hand_example().ext_prototypes()
    # p_0^ext = ([1, 0] + [3, 0] + [5, 3]) / 3 = [9, 3] / 3 = [3, 1]
    np.testing.assert_array_equal(ext[0], [3.0, 1.0])
    # p_1^ext = ([0, 2] + [0, 4]) / 2 = [0, 3]: divided by the 2 clients that sent it, not by all 3
    # (eq. 14's 1/|S^t| would give [0, 2]; see the module docstring)
    np.testing.assert_array_equal(ext[1], [0.0, 3.0])
    assert sorted(ext) == [0, 1]


def test_global_is_n_weighted_over_senders():
    glob = _hand_example().global_prototypes()
    # p_2^g = (1*[2, 2] + 3*[6, 6]) / (1 + 3) = [20, 20] / 4 = [5, 5]
    np.testing.assert_array_equal(glob[2], [5.0, 5.0])
    # p_3^g: one sender -> its prototype, whatever its count
    np.testing.assert_array_equal(glob[3], [1.0, 1.0])
    # class 4: no client has it -> undefined (eq. 15), absent
    assert sorted(glob) == [2, 3]


def test_anchors_hand_example():
    agg = _hand_example()
    anchors = agg.anchors()
    # public classes -> ext; uncovered -> n-weighted global; class 4 nobody has -> no anchor
    assert sorted(anchors) == [0, 1, 2, 3]
    np.testing.assert_array_equal(anchors[0], [3.0, 1.0])
    np.testing.assert_array_equal(anchors[1], [0.0, 3.0])
    np.testing.assert_array_equal(anchors[2], [5.0, 5.0])
    np.testing.assert_array_equal(anchors[3], [1.0, 1.0])
    assert all(a.dtype == np.float32 for a in anchors.values())
    assert agg.senders == 3


def test_single_client():
    agg = ErpaAggregator(3, 2, public_classes=[0])
    agg.add({0: A([1.0, 2.0])}, {2: A([3.0, 4.0])}, {2: 7})
    anchors = agg.anchors()
    np.testing.assert_array_equal(anchors[0], [1.0, 2.0])
    np.testing.assert_array_equal(anchors[2], [3.0, 4.0])
    assert 1 not in anchors


def test_no_uploads_no_anchors():
    assert ErpaAggregator(3, 2, public_classes=[0, 2]).anchors() == {}


def test_no_public_classes_is_fedproto_weighted():
    agg = ErpaAggregator(2, 1, public_classes=[])
    agg.add({}, {0: A([1.0])}, {0: 1})
    agg.add({}, {0: A([4.0])}, {0: 2})
    # (1*1 + 2*4) / 3 = 3
    np.testing.assert_array_equal(agg.anchors()[0], [3.0])


@pytest.mark.parametrize(
    "public, local, counts, match",
    [
        ({2: A([1.0, 1.0])}, {}, {}, "no public data"),  # public proto for an uncovered class
        ({}, {0: A([1.0, 1.0])}, {0: 1}, "public-covered"),  # local proto for a public class
        ({}, {2: A([1.0, 1.0])}, {}, "count"),  # missing n_kc
        ({0: A([1.0, 1.0])}, {2: A([np.nan, 1.0])}, {2: 1}, "NaN"),  # good public, bad local
        ({0: A([1.0, 1.0, 1.0])}, {}, {}, "shape"),
    ],
)
def test_rejected_upload_leaves_state_unchanged(public, local, counts, match):
    agg = ErpaAggregator(3, 2, public_classes=[0, 1])
    agg.add({0: A([2.0, 2.0])}, {2: A([4.0, 4.0])}, {2: 1})
    with pytest.raises(ValueError, match=match):
        agg.add(public, local, counts)
    assert agg.senders == 1
    anchors = agg.anchors()
    np.testing.assert_array_equal(anchors[0], [2.0, 2.0])
    np.testing.assert_array_equal(anchors[2], [4.0, 4.0])


def test_bad_public_classes():
    with pytest.raises(ValueError, match="duplicates"):
        ErpaAggregator(3, 2, public_classes=[0, 0])
    with pytest.raises(ValueError, match="out of range"):
        ErpaAggregator(3, 2, public_classes=[3])


def test_combine_anchors_rule():
    ext = {0: A([1.0, 0.0]), 3: A([9.0, 9.0])}
    glob = {0: A([5.0, 5.0]), 1: A([0.0, 1.0]), 2: A([2.0, 2.0])}
    out = combine_anchors(ext, glob, public_classes=[0, 1])
    # 0: public and ext present -> ext (glob[0] ignored)
    np.testing.assert_array_equal(out[0], [1.0, 0.0])
    # 1: public but no ext arrived this round -> glob stands in
    np.testing.assert_array_equal(out[1], [0.0, 1.0])
    # 2: not public -> glob
    np.testing.assert_array_equal(out[2], [2.0, 2.0])
    # 3: ext for a class that is not public-covered -> ignored (weight 1 - delta_c = 0), and no glob
    assert sorted(out) == [0, 1, 2]


def test_combine_anchors_returns_copies():
    g = A([1.0, 2.0], dtype=np.float32)
    out = combine_anchors({}, {0: g}, [])
    out[0][0] = 99.0
    assert g[0] == 1.0


def test_unit_anchors_hand_example() -> None:
    consensus = np.array([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])
    # class 0 public, two senders: (1, 0) + (0, 1) -> normalised (1, 1)/sqrt(2); class 1 public but
    # nobody sent it: the consensus row; class 2 not public: the consensus row whatever the sums say
    S = np.array([[1.0, 1.0], [0.0, 0.0], [5.0, 0.0]])
    K = np.array([2, 0, 1])
    out = unit_anchors(S, K, consensus, public_classes=[0, 1])
    r = 1 / np.sqrt(2)
    np.testing.assert_allclose(out, [[r, r], [0.0, 1.0], [0.6, 0.8]])
    assert out is not consensus and consensus[0].tolist() == [1.0, 0.0]  # a new array


def test_unit_anchors_keep_the_consensus_row_when_public_prototypes_cancel() -> None:
    out = unit_anchors(np.zeros((1, 2)), np.array([2]), np.array([[0.0, 1.0]]), public_classes=[0])
    assert out.tolist() == [[0.0, 1.0]]


def test_unit_anchors_refuse_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="do not match"):
        unit_anchors(np.zeros((2, 2)), np.array([1]), np.zeros((2, 2)), public_classes=[0])
