"""Round trips and size choices of the wire codec (arrays, sparse vectors, envelope)."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from protofl.errors import WireError
from protofl.sparse import SparseVector
from protofl.wire.codec import (
    KINDS,
    PHASES,
    Envelope,
    Limits,
    decode_array,
    decode_sparse,
    encode_array,
    encode_sparse,
    pack_envelope,
    unpack_envelope,
)

SHAPES = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=7)
F32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
F16_RANGE = st.floats(min_value=-65504, max_value=65504, width=32)


def roundtrip(a: np.ndarray, dt: str) -> np.ndarray:
    # Through real msgpack bytes, so float64 scale/zero and bin types are exercised too.
    obj = msgpack.unpackb(msgpack.packb(encode_array(a, dt), use_bin_type=True), raw=False)
    return decode_array(obj, what="test array")


@given(hnp.arrays(np.float32, SHAPES, elements=F32))
def test_f4_exact(a: np.ndarray) -> None:
    out = roundtrip(a, "f4")
    assert out.dtype == np.float32 and out.shape == a.shape
    assert np.array_equal(out, a)


@given(hnp.arrays(np.float32, SHAPES, elements=F16_RANGE))
def test_f2_within_float16_rounding(a: np.ndarray) -> None:
    out = roundtrip(a, "f2")
    assert out.dtype == np.float32 and out.shape == a.shape
    # Exactly what a float16 cast gives: round-to-nearest-even, subnormals kept.
    assert np.array_equal(out, a.astype(np.float16).astype(np.float32))


@given(hnp.arrays(np.float32, SHAPES, elements=F32))
def test_q8_within_half_a_step(a: np.ndarray) -> None:
    enc = encode_array(a, "q8")
    out = roundtrip(a, "q8")
    assert out.dtype == np.float32 and out.shape == a.shape
    if a.size == 0:
        return
    # Half a quantisation step, plus float64 arithmetic and the final float32 rounding of the result.
    tol = enc["scale"] * (0.5 + 1e-6) + float(np.abs(a).max()) * 2.0**-23
    assert np.abs(out.astype(np.float64) - a.astype(np.float64)).max() <= tol


def test_q8_full_float32_range_stays_finite() -> None:
    top = float(np.finfo(np.float32).max)
    a = np.array([-top, 0.0, top], np.float32)
    out = roundtrip(a, "q8")
    assert out[0] == -top and out[2] == top


@given(st.floats(width=32, allow_nan=False, allow_infinity=False), SHAPES)
def test_q8_constant_arrays_exact(c: float, shape: tuple[int, ...]) -> None:
    a = np.full(shape, c, dtype=np.float32)
    enc = encode_array(a, "q8")
    assert enc["scale"] == 1.0  # never 0: decoders reject scale <= 0
    assert np.array_equal(roundtrip(a, "q8"), a)


@pytest.mark.parametrize("dt,dtype", [("u1", np.uint8), ("u2", np.uint16), ("u4", np.uint32)])
@given(data=st.data())
def test_unsigned_exact(dt: str, dtype: type, data: st.DataObject) -> None:
    a = data.draw(hnp.arrays(dtype, SHAPES))
    out = roundtrip(a, dt)
    assert out.dtype == dtype and out.shape == a.shape
    assert np.array_equal(out, a)


def test_wire_bytes_are_little_endian() -> None:
    assert encode_array(np.array([1], np.uint16), "u2")["b"] == b"\x01\x00"
    assert encode_array(np.array([1], np.uint32), "u4")["b"] == b"\x01\x00\x00\x00"
    assert encode_array(np.array([1.0], np.float32), "f4")["b"] == b"\x00\x00\x80\x3f"
    big = np.array([1.0, 2.0], dtype=">f4")
    assert encode_array(big, "f4")["b"] == np.array([1.0, 2.0], "<f4").tobytes()


def test_float_codes_decode_to_float32_and_copies_are_writable() -> None:
    for dt in ("f4", "f2", "q8"):
        out = decode_array(encode_array(np.array([[1.0, -2.5]]), dt), what="x")
        assert out.dtype == np.float32 and out.flags.writeable
    out = decode_array(encode_array(np.array([7], np.uint16), "u2"), what="x")
    assert out.dtype == np.uint16 and out.flags.writeable


@pytest.mark.parametrize(
    "a,dt,reason",
    [
        (np.array([1.0, np.nan]), "f4", "NaN"),
        (np.array([np.inf]), "q8", "NaN, inf"),
        (np.array([1e30]), "f4", None),  # fits float32: fine
        (np.array([1e39]), "f4", "beyond float32"),
        (np.array([70000.0]), "f2", "float16 range"),
        (np.array([True]), "u1", "packbits"),
        (np.array([256]), "u1", "[0, 255]"),
        (np.array([-1]), "u2", "[0, 65535]"),
        (np.array([1.5]), "u4", "integer arrays"),
        (np.zeros([1] * 9), "f4", "9 dimensions"),
        (np.zeros(2), "f8", "unknown wire dtype"),
    ],
)
def test_encode_rejects_what_the_code_cannot_hold(a: np.ndarray, dt: str, reason: str | None) -> None:
    if reason is None:
        encode_array(a, dt)
        return
    with pytest.raises(ValueError, match=reason.replace("[", r"\[").replace("]", r"\]").replace("+", r"\+")):
        encode_array(a, dt)


def test_decode_array_constraints() -> None:
    enc = encode_array(np.zeros((3, 51), np.float32), "f4")
    assert decode_array(enc, what="p", dts={"f4"}, ndim=2).shape == (3, 51)
    with pytest.raises(WireError, match="p: dtype f4 not allowed here"):
        decode_array(enc, what="p", dts={"f2"})
    with pytest.raises(WireError, match="p: expected 1 dimensions"):
        decode_array(enc, what="p", ndim=1)
    bad = dict(enc, b=enc["b"][:600])
    with pytest.raises(WireError, match=r"prototype values: shape \[3, 51\] needs 612 bytes, got 600"):
        decode_array(bad, what="prototype values")
    with pytest.raises(WireError, match="over the limit 100"):
        decode_array(enc, what="p", limits=Limits(max_elements=100))


def test_zero_size_arrays() -> None:
    for dt in ("f4", "f2", "q8", "u1", "u2", "u4"):
        a = np.zeros((0, 512), np.uint8 if dt[0] == "u" else np.float32)
        out = decode_array(encode_array(a, dt), what="x")
        assert out.shape == (0, 512)


# --- sparse --------------------------------------------------------------------------------------


@st.composite
def sparse_vectors(draw: st.DrawFn, max_n: int = 3000) -> SparseVector:
    n = draw(st.integers(0, max_n))
    idx = sorted(draw(st.sets(st.integers(0, n - 1), max_size=min(n, 200)))) if n else []
    vals = draw(hnp.arrays(np.float32, len(idx), elements=F32))
    return SparseVector(n, np.array(idx, dtype=np.int64), vals)


def both_forms(sv: SparseVector) -> tuple[dict, dict]:
    """Index and mask forms built by hand, independently of the encoder's size arithmetic."""
    idt = "u2" if sv.n < 65536 else "u4"
    bits = np.zeros(sv.n, bool)
    bits[sv.indices] = True
    v = encode_array(sv.values, "f4")
    by_index = {"n": sv.n, "i": encode_array(sv.indices, idt), "v": v}
    by_mask = {"n": sv.n, "mask": encode_array(np.packbits(bits, bitorder="little"), "u1"), "v": v}
    return by_index, by_mask


def packed_len(obj: dict) -> int:
    return len(msgpack.packb(obj, use_bin_type=True))


@settings(max_examples=200, deadline=None)
@given(sparse_vectors())
def test_sparse_roundtrip_picks_smaller_and_forms_agree(sv: SparseVector) -> None:
    enc = encode_sparse(sv)
    by_index, by_mask = both_forms(sv)
    assert packed_len(enc) == min(packed_len(by_index), packed_len(by_mask))
    for obj in (enc, by_index, by_mask):
        out = decode_sparse(msgpack.unpackb(msgpack.packb(obj, use_bin_type=True)), what="u")
        assert out.n == sv.n and out.indices.dtype == np.int64 and out.values.dtype == np.float32
        assert np.array_equal(out.indices, sv.indices) and np.array_equal(out.values, sv.values)


@settings(max_examples=30, deadline=None)
@given(sparse_vectors(max_n=200_000))
def test_sparse_large_n_uses_u4_indices(sv: SparseVector) -> None:
    enc = encode_sparse(sv)
    by_index, by_mask = both_forms(sv)
    assert packed_len(enc) == min(packed_len(by_index), packed_len(by_mask))
    if "i" in enc:
        assert enc["i"]["dt"] == ("u2" if sv.n < 65536 else "u4")
    out = decode_sparse(enc, what="u")
    assert np.array_equal(out.to_dense(), sv.to_dense())


def test_sparse_form_choice_examples() -> None:
    # 90% dense over 1000 coordinates: 900 u2 indices = 1800 bytes vs a 125-byte mask.
    dense = SparseVector(1000, np.arange(900, dtype=np.int64), np.ones(900, np.float32))
    assert "mask" in encode_sparse(dense)
    # 5 of 100,000 coordinates: 20 bytes of u4 indices vs a 12,500-byte mask.
    sparse = SparseVector(100_000, np.array([0, 7, 50_000, 65_536, 99_999]), np.ones(5, np.float32))
    enc = encode_sparse(sparse)
    assert "i" in enc and enc["i"]["dt"] == "u4"
    # Mask bit order is little: coordinate 8k + j is bit j of byte k.
    one = SparseVector(16, np.array([0, 1, 2, 3, 4, 5, 6, 9]), np.ones(8, np.float32))
    assert encode_sparse(one)["mask"]["b"] == bytes([0b0111_1111, 0b0000_0010])


def test_sparse_value_dtypes_and_empty() -> None:
    sv = SparseVector(50, np.array([3, 10, 49]), np.array([0.5, -1.25, 3.0], np.float32))
    for dt in ("f2", "q8"):
        out = decode_sparse(encode_sparse(sv, dt), what="u")
        assert np.allclose(out.values, sv.values, atol=0.03)
    empty = decode_sparse(encode_sparse(SparseVector(0, np.zeros(0, np.int64), np.zeros(0, np.float32))), what="u")
    assert empty.n == 0 and empty.nnz == 0


@pytest.mark.parametrize(
    "sv,reason",
    [
        (SparseVector(10, np.array([3, 1]), np.ones(2, np.float32)), "strictly increasing"),
        (SparseVector(10, np.array([1, 1]), np.ones(2, np.float32)), "strictly increasing"),
        (SparseVector(10, np.array([10]), np.ones(1, np.float32)), "strictly increasing"),
        (SparseVector(2**32, np.array([1]), np.ones(1, np.float32)), "2\\*\\*32"),
        (SparseVector(10, np.array([1]), np.array([np.nan], np.float32)), "NaN"),
    ],
)
def test_encode_sparse_rejects_bad_vectors(sv: SparseVector, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        encode_sparse(sv)


# --- envelope ------------------------------------------------------------------------------------

NAMES = st.from_regex(r"\A[A-Za-z0-9_.-]{1,64}\Z")


@given(
    kind=st.sampled_from(sorted(KINDS)),
    fed=NAMES,
    sender=NAMES,
    rnd=st.integers(0, 2**31 - 1),
    phase=st.sampled_from(sorted(PHASES)),
    msg_id=st.text(max_size=64),
    body=st.dictionaries(st.text(max_size=8), st.integers() | st.binary(max_size=20) | st.none(), max_size=5),
)
def test_envelope_roundtrip(kind: str, fed: str, sender: str, rnd: int, phase: str, msg_id: str, body: dict) -> None:
    body = {k: (v if not isinstance(v, int) or -(2**63) <= v < 2**64 else 0) for k, v in body.items()}
    env = Envelope(1, kind, fed, rnd, phase, sender, msg_id, body)
    assert unpack_envelope(pack_envelope(env)) == env


def test_pack_envelope_refuses_what_unpack_would_reject() -> None:
    with pytest.raises(ValueError, match="not a valid name"):
        pack_envelope(Envelope(1, "join", "fed/x", 0, "", "s", "m", {}))
    with pytest.raises(ValueError, match="unsupported wire version 2"):
        pack_envelope(Envelope(2, "join", "fed", 0, "", "s", "m", {}))


def test_unpack_envelope_accepts_bytearray_and_memoryview() -> None:
    data = pack_envelope(Envelope(1, "status", "fed", 3, "train", "rpi-07", "abc", {"state": "ok"}))
    assert unpack_envelope(bytearray(data)).round == 3
    assert unpack_envelope(memoryview(data)).sender == "rpi-07"
    with pytest.raises(WireError, match="expected bytes"):
        unpack_envelope("not bytes")  # type: ignore[arg-type]


def test_limits_defaults() -> None:
    lim = Limits()
    assert lim.max_message_bytes == 32 * 2**20 and lim.max_elements == 16 * 2**20
    assert (lim.max_list_len, lim.max_map_len) == (100_000, 4096)
    assert lim.max_str_len == 2**20 and lim.max_bin_len == 64 * 2**20
    assert math.isfinite(lim.max_objects)
