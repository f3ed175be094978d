"""FedAvg: sample-weighted mean, hand-computed."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protofl.algorithms.fedavg import FedAvgAggregator


def test_weighted_mean_hand_example():
    agg = FedAvgAggregator(2)
    agg.add(np.array([1.0, 2.0], dtype=np.float32), 1)
    agg.add(np.array([4.0, 8.0], dtype=np.float32), 3)
    # (1*[1, 2] + 3*[4, 8]) / (1 + 3) = [13, 26] / 4 = [3.25, 6.5]
    out = agg.result()
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, [3.25, 6.5])
    assert agg.senders == 2


def test_single_client_gets_its_own_vector_back():
    agg = FedAvgAggregator(3)
    agg.add(np.array([0.5, -1.0, 7.0]), 42)
    np.testing.assert_array_equal(agg.result(), [0.5, -1.0, 7.0])


def test_nothing_added_raises():
    with pytest.raises(ValueError, match="no uploads"):
        FedAvgAggregator(4).result()


@pytest.mark.parametrize(
    "vector, weight",
    [
        (np.zeros(3), 1.0),  # wrong length
        (np.array([1.0, np.nan]), 1.0),
        (np.array([1.0, np.inf]), 1.0),
        (np.ones(2), 0.0),
        (np.ones(2), -2.0),
        (np.ones(2), float("nan")),
    ],
)
def test_bad_upload_rejected_and_state_unchanged(vector, weight):
    agg = FedAvgAggregator(2)
    agg.add(np.array([2.0, 4.0]), 2)
    with pytest.raises(ValueError):
        agg.add(vector, weight)
    assert agg.senders == 1
    np.testing.assert_array_equal(agg.result(), [2.0, 4.0])


def test_bad_dim():
    with pytest.raises(ValueError):
        FedAvgAggregator(0)


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.floats(-1e3, 1e3), min_size=3, max_size=3),
            st.integers(1, 10_000),
        ),
        min_size=1,
        max_size=8,
    )
)
def test_matches_numpy_average(uploads):
    agg = FedAvgAggregator(3)
    for v, w in uploads:
        agg.add(np.array(v), w)
    expected = np.average(np.array([v for v, _ in uploads]), axis=0, weights=[w for _, w in uploads])
    np.testing.assert_allclose(agg.result(), expected.astype(np.float32), rtol=1e-6, atol=1e-4)
