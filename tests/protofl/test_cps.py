"""CPS (TinyProto eqs. 7-8): masks, compression, reconstruction, packing; hand-computed."""

import itertools

import numpy as np
import pytest

from protofl.algorithms.cps import make_masks, min_pairwise_hamming, pack_masks, unpack_masks
from protofl.algorithms.support import compress, compress_table, reconstruct, reconstruct_table


def _all_pair_distances(masks):
    return [int((a != b).sum()) for a, b in itertools.combinations(masks, 2)]


def test_disjoint_masks_when_they_fit():
    # C*s = 3*3 = 9 <= m = 10 -> disjoint supports
    masks = make_masks(num_classes=3, m=10, s=3, seed=0)
    assert masks.shape == (3, 10) and masks.dtype == bool
    assert (masks.sum(axis=1) == 3).all()
    assert masks.sum(axis=0).max() == 1  # no dim used by two classes
    # every pair at the maximum possible distance 2s = 6
    assert _all_pair_distances(masks) == [6, 6, 6]
    assert min_pairwise_hamming(masks) == 6


def test_disjoint_exact_fit_and_paper_figure_3():
    # TinyProto Fig. 3: 5 classes, 5 dims, s = 1 -> a permutation of the identity
    masks = make_masks(5, 5, 1, seed=3)
    assert (masks.sum(axis=0) == 1).all() and (masks.sum(axis=1) == 1).all()
    assert min_pairwise_hamming(masks) == 2


def test_greedy_hand_example():
    # C*s = 3*2 = 6 > m = 4 -> greedy. The 2-subsets of 4 dims: two subsets are at distance 4 only if
    # complementary, otherwise 2. The greedy's second mask must be the complement of the first
    # (distance 4 beats 2), and the third cannot be far from both, so the minimum is 2.
    masks = make_masks(num_classes=3, m=4, s=2, seed=0)
    assert (masks.sum(axis=1) == 2).all()
    assert (masks[0] ^ masks[1]).all()
    assert min_pairwise_hamming(masks) == 2


def test_greedy_beats_first_random_candidate():
    # candidates=1 is "take a random subset"; 64 candidates choose for distance
    random_min = min_pairwise_hamming(make_masks(30, 64, 8, seed=5, candidates=1))
    greedy_min = min_pairwise_hamming(make_masks(30, 64, 8, seed=5, candidates=64))
    assert greedy_min > random_min


@pytest.mark.parametrize("shape", [(3, 10, 3), (12, 20, 4), (100, 512, 51)])
def test_deterministic_given_seed(shape: tuple[int, int, int]) -> None:
    a = make_masks(*shape, seed=7)
    b = make_masks(*shape, seed=7)
    np.testing.assert_array_equal(a, b)
    assert (a.sum(axis=1) == shape[2]).all()
    assert not np.array_equal(a, make_masks(*shape, seed=8))


def test_s_equal_m_is_all_ones():
    masks = make_masks(3, 4, 4)
    assert masks.all() and min_pairwise_hamming(masks) == 0


@pytest.mark.parametrize("args", [(3, 10, 0), (3, 10, 11), (0, 10, 2), (3, 10, 2, 0, 0)])
def test_make_masks_rejects(args):
    with pytest.raises(ValueError):
        make_masks(*args)


def test_min_pairwise_hamming_hand_example():
    masks = np.array([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 1, 1]], dtype=bool)
    # d(0,1) = 2 (dims 1, 2 differ), d(0,2) = 4, d(1,2) = 2 (dims 0, 3) -> 2
    assert min_pairwise_hamming(masks) == 2
    # one mask: no pair, the largest possible distance m by convention
    assert min_pairwise_hamming(masks[:1]) == 4
    with pytest.raises(ValueError):
        min_pairwise_hamming(masks.astype(np.uint8))


def test_compress_reconstruct_hand_example():
    p = np.array([5.0, 6.0, 7.0, 8.0])
    mask = np.array([False, True, False, True])
    c = compress(p, mask)
    np.testing.assert_array_equal(c, [6.0, 8.0])  # values on the mask, ascending dim order
    assert c.dtype == np.float32
    r = reconstruct(c, mask)
    np.testing.assert_array_equal(r, [0.0, 6.0, 0.0, 8.0])  # zeros off the mask (eq. 7)
    assert r.dtype == np.float32


def test_compress_reconstruct_errors():
    mask = np.array([True, False, True])
    with pytest.raises(ValueError):
        compress(np.zeros(4), mask)
    with pytest.raises(ValueError):
        compress(np.zeros(3), mask.astype(int))
    with pytest.raises(ValueError, match="expected 2 values"):
        reconstruct(np.zeros(3), mask)


def test_tables_roundtrip():
    masks = make_masks(4, 12, 3, seed=1)
    rng = np.random.default_rng(0)
    protos = {0: rng.standard_normal(12), 3: rng.standard_normal(12)}  # classes 1, 2 absent
    comp = compress_table(protos, masks)
    assert sorted(comp) == [0, 3] and all(v.shape == (3,) for v in comp.values())
    back = reconstruct_table(comp, masks)
    for c in (0, 3):
        np.testing.assert_allclose(back[c], np.where(masks[c], protos[c], 0.0).astype(np.float32))
    with pytest.raises(ValueError, match="no mask"):
        compress_table({4: np.zeros(12)}, masks)
    assert compress_table({}, masks) == {}


def test_pack_hand_example():
    masks = np.array([[1, 0, 0, 0, 0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0, 0, 1, 0, 1]], dtype=bool)
    packed = pack_masks(masks)
    # row 0: 1000_0000 | 11(00_0000) = 0x80, 0xC0; row 1: 0000_0001 | 01(00_0000) = 0x01, 0x40
    np.testing.assert_array_equal(packed, [[0x80, 0xC0], [0x01, 0x40]])
    assert packed.dtype == np.uint8
    np.testing.assert_array_equal(unpack_masks(packed, 2, 10), masks)


def test_pack_roundtrip_and_size():
    masks = make_masks(10, 500, 50, seed=2)
    packed = pack_masks(masks)
    assert packed.shape == (10, 63)  # ceil(500 / 8) bytes per class
    np.testing.assert_array_equal(unpack_masks(packed, 10, 500), masks)


def test_unpack_rejects_corrupt():
    packed = pack_masks(np.ones((2, 10), dtype=bool))
    bad = packed.copy()
    bad[0, 1] |= 0x01  # a padding bit
    with pytest.raises(ValueError, match="padding"):
        unpack_masks(bad, 2, 10)
    with pytest.raises(ValueError):
        unpack_masks(packed, 3, 10)
    with pytest.raises(ValueError):
        unpack_masks(packed.astype(np.int16), 2, 10)


def test_off_mask_energy_hand_example() -> None:
    from protofl.algorithms.support import off_mask_energy

    masks = np.array([[True, False, False], [False, True, True]])
    z = np.array(
        [
            [3.0, 4.0, 0.0],  # class 0: on-mask 9, off-mask 16
            [1.0, 0.0, 2.0],
        ]
    )  # class 1: on-mask 4, off-mask 1
    assert off_mask_energy(z, np.array([0, 1]), masks) == pytest.approx(17 / 30)
    assert off_mask_energy(np.zeros((2, 3)), np.array([0, 1]), masks) == 0.0


def test_restrict_to_masks_hand_example() -> None:
    from protofl.algorithms.support import restrict_to_masks

    masks = np.array([[True, True, False], [False, False, True], [False, True, True]])
    P = np.array(
        [
            [3.0, 4.0, 12.0],  # cut to (3, 4, 0) -> (0.6, 0.8, 0)
            [1.0, 1.0, -2.0],  # cut to (0, 0, -2) -> (0, 0, -1)
            [1.0, 0.0, 0.0],
        ]
    )  # zero on its support: the normalised mask (0, 1/sqrt2, 1/sqrt2)
    out = restrict_to_masks(P, masks)
    np.testing.assert_allclose(out, [[0.6, 0.8, 0.0], [0.0, 0.0, -1.0], [0.0, 2**-0.5, 2**-0.5]], atol=1e-7)
    assert out.dtype == np.float32
    with pytest.raises(ValueError, match="shape"):
        restrict_to_masks(P[:2], masks)
