"""Prototype scaling (TinyProto eqs. 10-11): scaled aggregation, mu and "auto"; hand-computed."""

import numpy as np
import pytest

from protofl.algorithms.scaling import ScaledAggregator, apply_mu, auto_rescale, scale_prototypes

A = np.array


def _hand_example():
    # client A holds classes 0, 1, 2; client B holds 0 and 2
    a = scale_prototypes({0: A([1.0, 2.0]), 1: A([3.0, 0.0]), 2: A([0.0, 1.0])}, {0: 2, 1: 1, 2: 4})
    b = scale_prototypes({0: A([3.0, 0.0]), 2: A([1.0, 1.0])}, {0: 1, 2: 2})
    return a, b


def test_scale_prototypes_hand_example():
    a, b = _hand_example()
    # n_kc * p_kc: 2*[1, 2] = [2, 4], 1*[3, 0] = [3, 0], 4*[0, 1] = [0, 4]
    np.testing.assert_array_equal(a[0], [2.0, 4.0])
    np.testing.assert_array_equal(a[1], [3.0, 0.0])
    np.testing.assert_array_equal(a[2], [0.0, 4.0])
    np.testing.assert_array_equal(b[2], [2.0, 2.0])
    assert a[0].dtype == np.float32


def test_scaled_aggregation_hand_example_two_clients_three_classes():
    a, b = _hand_example()
    agg = ScaledAggregator(num_classes=3, dim=2)
    agg.add(a)
    agg.add(b)
    G = agg.result()
    # every class that anybody sent is aggregated (the published code did class 0 only)
    assert sorted(G) == [0, 1, 2]
    # G_0 = ([2, 4] + [3, 0]) / |N_0| = [5, 4] / 2 = [2.5, 2]   (the published code: [5, 4], no 1/|N_c|)
    np.testing.assert_array_equal(G[0], [2.5, 2.0])
    # G_1 = [3, 0] / 1: only A has class 1
    np.testing.assert_array_equal(G[1], [3.0, 0.0])
    # G_2 = ([0, 4] + [2, 2]) / 2 = [1, 3]
    np.testing.assert_array_equal(G[2], [1.0, 3.0])
    assert not np.array_equal(G[0], [5.0, 4.0])
    assert agg.senders == 2


def test_class_nobody_sent_is_absent():
    agg = ScaledAggregator(4, 2)
    agg.add({1: A([2.0, 2.0])})
    assert sorted(agg.result()) == [1]


def test_works_on_compressed_vectors():
    # with CPS the vectors are s long; dim is s
    agg = ScaledAggregator(2, 3)
    agg.add({0: A([3.0, 6.0, 9.0])})
    agg.add({0: A([1.0, 2.0, 3.0])})
    np.testing.assert_array_equal(agg.result()[0], [2.0, 4.0, 6.0])


def test_rejected_upload_leaves_state_unchanged():
    agg = ScaledAggregator(3, 2)
    agg.add({0: A([2.0, 2.0])})
    for bad in ({0: A([1.0, 1.0]), 1: A([np.nan, 0.0])}, {0: A([1.0])}, {5: A([1.0, 1.0])}):
        with pytest.raises(ValueError):
            agg.add(bad)
    assert agg.senders == 1
    np.testing.assert_array_equal(agg.result()[0], [2.0, 2.0])


@pytest.mark.parametrize(
    "protos, counts",
    [
        ({0: A([1.0])}, {}),
        ({0: A([1.0])}, {0: 0}),
        ({0: A([1.0])}, {0: 1.5}),
        ({0: A([np.inf])}, {0: 1}),
    ],
)
def test_scale_prototypes_rejects(protos, counts):
    with pytest.raises(ValueError):
        scale_prototypes(protos, counts)


def test_apply_mu_hand_example():
    out = apply_mu({0: A([2.5, 2.0]), 2: A([1.0, 3.0])}, mu=0.5)
    np.testing.assert_array_equal(out[0], [1.25, 1.0])
    np.testing.assert_array_equal(out[2], [0.5, 1.5])
    assert out[0].dtype == np.float32
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError):
            apply_mu({0: A([1.0])}, bad)


def test_auto_rescale_hand_example():
    G = {0: A([3.0, 4.0]), 1: A([0.0, 0.0]), 2: A([6.0, 8.0])}
    local_norms = {0: 10.0, 3: 2.0, 4: 4.0}
    out = auto_rescale(G, local_norms)
    # class 0 held locally: direction [3, 4]/5 = [0.6, 0.8], norm 10 -> [6, 8]
    np.testing.assert_allclose(out[0], [6.0, 8.0], rtol=1e-7)
    # class 1: zero global prototype has no direction -> stays zero
    np.testing.assert_array_equal(out[1], [0.0, 0.0])
    # class 2 not held locally: median of the client's norms (10, 2, 4) = 4 -> [0.6, 0.8] * 4 = [2.4, 3.2]
    np.testing.assert_allclose(out[2], [2.4, 3.2], rtol=1e-6)
    assert sorted(out) == [0, 1, 2]


def test_auto_rescale_rejects():
    with pytest.raises(ValueError, match="at least one"):
        auto_rescale({0: A([1.0, 0.0])}, {})
    with pytest.raises(ValueError):
        auto_rescale({0: A([1.0, 0.0])}, {0: -1.0})
    with pytest.raises(ValueError):
        auto_rescale({0: A([np.nan, 0.0])}, {0: 1.0})
