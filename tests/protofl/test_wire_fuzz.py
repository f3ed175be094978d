"""Malformed input: each named case fails with its own reason, and random input never escapes WireError."""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import numpy as np
import pytest

from protofl.errors import WireError
from protofl.sparse import SparseVector
from protofl.wire import (
    DEFAULT_LIMITS,
    MESSAGE_TYPES,
    Config,
    Join,
    Limits,
    Metrics,
    Pace,
    ParamsUpload,
    ProtoSet,
    ProtoUpload,
    PublicSet,
    Resend,
    RoundStart,
    SaKeys,
    SaMasked,
    SaRoster,
    SaRouted,
    SaShares,
    SaSurvivors,
    SaUnmask,
    Status,
    decode_message,
    encode_message,
)

PROTOS = ProtoUpload(
    ProtoSet(np.array([1, 4, 7]), np.arange(12, dtype=np.float32).reshape(3, 4), np.array([5, 6, 7])), None, 18
)
BY_INDEX = ParamsUpload(SparseVector(1000, np.array([3, 10, 20]), np.ones(3, np.float32)), 10, 2)
BY_MASK = ParamsUpload(SparseVector(12, np.arange(8), np.ones(8, np.float32)), 10, 2)
ROUND_Q8 = RoundStart(100.0, adapter=np.linspace(-1, 1, 6, dtype=np.float32), dt="q8")
METRICS = Metrics(4, 3, 2, 1, np.full((2, 3), 0.25, np.float32), 1.5, 0.7, {"norm": 2.0})
CONFIG = Config("tiny", {"lr": 0.1}, [("head", (3, 4))], np.zeros((3, 5), bool), {"max_up": 1000})
PUBLIC = PublicSet(np.zeros((2, 1, 2, 2), np.uint8), np.array([0, 1]), [0, 1])
SMALL = [
    Join("cnn", 10, "rpi4", "0.1", "tok"),
    CONFIG,
    PUBLIC,
    ROUND_Q8,
    RoundStart(5.0, params=np.ones(4, np.float32), targets=PROTOS.local, participants=["a", "b"], final=True),
    PROTOS,
    ProtoUpload(None, ProtoSet(np.array([2]), np.ones((1, 3), np.float32), dt="f2"), 1),
    BY_INDEX,
    BY_MASK,
    ParamsUpload(np.ones(5, np.float32), 3, 1),
    METRICS,
    Status("online", "ok"),
    Resend("uploads"),
    Pace(1_800_000_000.0, "its link cannot finish the round by its deadline"),
    SaKeys(b"c" * 32, b"s" * 32),
    SaRoster({"rpi-08": (b"c" * 32, b"s" * 32)}, t=1, frac_bits=16, bound=100.0, weighted=True),
    SaShares([b"x" * 80]),
    SaRouted([0, 2], [b"x" * 80, b"z" * 80]),
    SaMasked(np.arange(6, dtype=np.uint32)),
    SaSurvivors([0, 3]),
    SaUnmask([b"y" * 32]),
]
SA_SHARES = SaShares([b"x" * 80])
SA_ROSTER = SaRoster({"a1": (b"c" * 32, b"s" * 32), "b2": (b"d" * 32, b"t" * 32)}, 1, 16, 100.0, False)
SA_ROUTED = SaRouted([0, 2], [b"x" * 80, b"z" * 80])
assert {type(m) for m in SMALL} == set(MESSAGE_TYPES.values())


def valid(msg: Any) -> bytes:
    return encode_message(msg, fed="fed", sender="rpi-07", round=3, phase="train", msg_id="m1")


def edit(msg: Any, fn: Callable[[dict], None]) -> Callable[[], bytes]:
    """Decode a valid message to plain msgpack values, break it with `fn`, and repack."""

    def make() -> bytes:
        top = msgpack.unpackb(valid(msg), raw=False)
        fn(top)
        return msgpack.packb(top, use_bin_type=True)

    return make


def put(path: str, value: Any) -> Callable[[dict], None]:
    def fn(top: dict) -> None:
        *parents, last = path.split(".")
        node = top
        for p in parents:
            node = node[p]
        node[last] = value

    return fn


def drop(key: str) -> Callable[[dict], None]:
    return lambda top: top.pop(key) and None


def raw(data: bytes) -> Callable[[], bytes]:
    return lambda: data


def u2(*v: int) -> bytes:
    return np.array(v, "<u2").tobytes()


CASES: list[tuple[str, Callable[[], bytes], str]] = [
    # envelope
    ("wrong_version", edit(PROTOS, put("v", 2)), "unsupported wire version 2; this build speaks 1"),
    ("old_version", edit(PROTOS, put("v", 0)), "upgrade protofl-edge on the other side"),
    ("version_as_str", edit(PROTOS, put("v", "1")), "unsupported wire version '1'"),
    ("unknown_kind", edit(PROTOS, put("kind", "hello")), "unknown kind 'hello'"),
    ("missing_key", edit(PROTOS, drop("msg_id")), "missing key 'msg_id'"),
    ("extra_key", edit(PROTOS, put("zz", 1)), "unknown key 'zz'"),
    ("non_map_top", raw(msgpack.packb([1, 2, 3])), "top level must be a map, got list"),
    ("truncated", lambda: valid(PROTOS)[:-3], "truncated msgpack"),
    ("trailing_bytes", lambda: valid(PROTOS) + b"\xc0", "trailing bytes"),
    ("oversize", lambda: valid(PROTOS), "over the limit of 64"),
    ("invalid_format_byte", raw(b"\xc1"), "invalid format byte"),
    # A top level that is not a map is refused by its first byte, so these two sit inside one:
    # a key that is not UTF-8, and a body nested too deeply to skip.
    ("invalid_utf8", raw(b"\x81\xa2\xff\xfe\xc0"), "not valid UTF-8"),
    ("too_deep", raw(b"\x81\xa4body" + b"\x91" * 5000 + b"\xc0"), "nested too deeply"),
    ("ext_type", edit(METRICS, put("body.extra", msgpack.ExtType(1, b"x"))), "ext types are not allowed"),
    ("timestamp_ext", edit(METRICS, put("body.loss", msgpack.Timestamp(1, 0))), "ext types"),
    ("non_str_map_key", edit(PROTOS, put("body", {1: 2})), "map keys must be strings"),
    ("bytes_map_key", edit(PROTOS, lambda t: t["body"].update({b"k": 1})), "map key b'k' is not a string"),
    ("bad_fed_name", edit(PROTOS, put("fed", "a/b")), "message fed: 'a/b' is not a valid name"),
    ("long_sender", edit(PROTOS, put("sender", "s" * 65)), "message sender"),
    ("round_negative", edit(PROTOS, put("round", -1)), "message round: -1 is outside"),
    ("round_too_big", edit(PROTOS, put("round", 2**31)), "message round: 2147483648 is outside"),
    ("round_as_bool", edit(PROTOS, put("round", True)), "message round: expected an integer, got bool"),
    ("unknown_phase", edit(PROTOS, put("phase", "eval")), "unknown phase 'eval'"),
    ("msg_id_too_long", edit(PROTOS, put("msg_id", "x" * 65)), "msg_id: 65 characters"),
    ("body_not_map", edit(PROTOS, put("body", [])), "body must be a map, got list"),
    ("too_many_objects", edit(CONFIG, put("body.params.l", list(range(100)))), "more than 50 msgpack"),
    ("string_over_limit", edit(Status("x" * 100), lambda t: None), "max_str_len"),
    ("list_over_limit", edit(CONFIG, put("body.params.l", [0] * 20)), "max_array_len"),
    # arrays
    (
        "nan_in_f4",
        edit(PROTOS, put("body.local.v.b", np.full(12, np.nan, "<f4").tobytes())),
        "protos local values: non-finite value (NaN or inf) at flat index 0",
    ),
    ("inf_in_f2", edit(METRICS, put("body.probs.b", np.full(6, np.inf, "<f2").tobytes())), "probs: non-finite"),
    ("q8_zero_scale", edit(ROUND_Q8, put("body.adapter.scale", 0.0)), "q8 scale must be > 0"),
    ("q8_nan_scale", edit(ROUND_Q8, put("body.adapter.scale", float("nan"))), "q8 scale: nan is not finite"),
    ("q8_inf_zero", edit(ROUND_Q8, put("body.adapter.zero", float("inf"))), "q8 zero: inf is not finite"),
    ("q8_overflow", edit(ROUND_Q8, put("body.adapter.scale", 1e300)), "round adapter: non-finite value"),
    ("q8_missing_scale", edit(ROUND_Q8, lambda t: t["body"]["adapter"].pop("scale")), "missing key 'scale'"),
    ("shape_bytes_mismatch", edit(PROTOS, put("body.local.v.sh", [3, 5])), "shape [3, 5] needs 60 bytes, got 48"),
    ("negative_dim", edit(PROTOS, put("body.local.v.sh", [-3, 4])), "negative dimension"),
    ("bool_dim", edit(PROTOS, put("body.local.v.sh", [True, 4])), "non-integer dimension"),
    ("shape_not_list", edit(PROTOS, put("body.local.v.sh", 12)), "shape must be a list"),
    ("huge_shape", edit(PROTOS, put("body.local.v.sh", [2**20, 2**20])), "elements, over the limit"),
    ("too_many_dims", edit(PROTOS, put("body.local.v.sh", [1] * 9)), "9 dimensions"),
    ("wrong_ndim", edit(PROTOS, put("body.local.v.sh", [12])), "expected 2 dimensions"),
    ("unknown_dt", edit(PROTOS, put("body.local.v.dt", "f8")), "unknown dtype 'f8'"),
    ("dt_not_allowed", edit(METRICS, put("body.probs.dt", "u2")), "dtype u2 not allowed here"),
    ("array_extra_key", edit(PROTOS, put("body.local.v.x", 1)), "unknown key 'x'"),
    ("array_str_bytes", edit(PROTOS, put("body.local.v.b", "abcd")), "'b' must be bin bytes"),
    # sparse
    ("unsorted_indices", edit(BY_INDEX, put("body.update.i.b", u2(10, 3, 20))), "not sorted ascending"),
    ("duplicate_indices", edit(BY_INDEX, put("body.update.i.b", u2(3, 3, 20))), "duplicate index 3"),
    ("index_out_of_range", edit(BY_INDEX, put("body.update.i.b", u2(3, 10, 1000))), "index 1000 out of range"),
    (
        "index_value_mismatch",
        edit(BY_INDEX, put("body.update.i", {"dt": "u2", "sh": [2], "b": u2(1, 2)})),
        "2 indices but 3",
    ),
    ("sparse_n_too_big", edit(BY_INDEX, put("body.update.n", 2**32)), "outside [0, 4294967295]"),
    ("sparse_n_over_limit", edit(BY_INDEX, put("body.update.n", 5000)), "exceeds the element limit"),
    ("mask_popcount", edit(BY_MASK, put("body.update.mask.b", bytes([0xFF, 0x01]))), "popcount 9"),
    ("mask_trailing_bits", edit(BY_MASK, put("body.update.mask.b", bytes([0xFF, 0x10]))), "beyond length 12"),
    (
        "mask_wrong_length",
        edit(BY_MASK, put("body.update.mask", {"dt": "u1", "sh": [1], "b": b"\xff"})),
        "mask has 1 bytes",
    ),
    # secure aggregation (protofl/secagg.py)
    ("sa_key_short", edit(SaKeys(b"c" * 32, b"s" * 32), put("body.c", b"c" * 31)), "c: expected 32 bytes, got 31"),
    ("sa_box_short", edit(SA_SHARES, put("body.boxes", b"x" * 81)), "81 bytes, not a whole number of 80-byte"),
    ("sa_boxes_a_map", edit(SA_SHARES, put("body.boxes", {"a": b"x" * 80})), "boxes: expected bytes, got dict"),
    ("sa_too_many_boxes", edit(SA_SHARES, put("body.boxes", b"x" * 80 * 1025)), "80-byte entries up to 1024"),
    ("sa_masked_f4", edit(SaMasked(np.zeros(3, np.uint32)), put("body.y.dt", "f4")), "dtype f4 not allowed here"),
    ("sa_unmask_33", edit(SaUnmask([b"y" * 32]), put("body.shares", b"y" * 33)), "not a whole number of 32-byte"),
    ("sa_roster_keys_short", edit(SA_ROSTER, put("body.keys", b"k" * 127)), "keys: expected 128 bytes, got 127"),
    ("sa_roster_unsorted", edit(SA_ROSTER, put("body.ids", ["b2", "a1"])), "ids: must be sorted, each once"),
    ("sa_roster_twice", edit(SA_ROSTER, put("body.ids", ["a1", "a1"])), "sorted, each once"),
    ("sa_roster_bad_id", edit(SA_ROSTER, put("body.ids", ["a/1", "b2"])), "is not a valid name"),
    (
        "sa_roster_too_many",
        edit(SA_ROSTER, put("body.ids", [f"d{i:04d}" for i in range(1025)])),
        "ids: expected a list of at most 1024",
    ),
    ("sa_routed_count", edit(SA_ROUTED, put("body.boxes", b"x" * 80)), "boxes: 1 for 2 senders"),
    ("sa_routed_trailing", edit(SA_ROUTED, put("body.senders", bytes([5, 0]))), "a last byte of zero bits"),
    ("sa_routed_mask_long", edit(SA_ROUTED, put("body.senders", b"\x01" * 129)), "at most 128 bytes of packed"),
    ("sa_survivors_ids", edit(SaSurvivors([0]), put("body.alive", ["rpi-08"])), "packed positions"),
    # the first forms of the five changed kinds are retired: refused by kind, before the body is read
    ("sa_first_form", edit(SA_SHARES, put("kind", "sa_shares")), "unknown kind 'sa_shares'"),
    # message bodies
    ("bool_as_int", edit(Join("cnn", 3), put("body.n_samples", True)), "n_samples: expected an integer, got bool"),
    ("float_as_int", edit(Join("cnn", 3), put("body.n_samples", 3.0)), "expected an integer, got float"),
    ("n_samples_negative", edit(Join("cnn", 3), put("body.n_samples", -5)), "n_samples: -5 is outside"),
    ("body_missing_key", edit(Join("cnn", 3), lambda t: t["body"].pop("token")), "join: missing key 'token'"),
    ("body_extra_key", edit(Status("ok"), put("body.x", 1)), "status: unknown key 'x'"),
    ("resend_unknown_ask", edit(Resend("join"), put("body.ask", "everything")), "ask: expected one of join, uploads"),
    ("resend_ask_not_str", edit(Resend("join"), put("body.ask", 7)), "ask: expected a string"),
    (
        "protoset_length_mismatch",
        edit(PROTOS, put("body.local.c", {"dt": "u2", "sh": [2], "b": u2(1, 4)})),
        "2 classes but 3 prototype rows",
    ),
    ("protoset_unsorted", edit(PROTOS, put("body.local.c.b", u2(4, 1, 7))), "classes: must be sorted"),
    (
        "counts_zero",
        edit(PROTOS, put("body.local.n.b", np.array([0, 6, 7], "<u4").tobytes())),
        "counts: values must lie in [1,",
    ),
    (
        "params_nested_depth",
        edit(CONFIG, put("body.params", {"a": {"b": {"c": {"d": {"e": 1}}}}})),
        "nested deeper than 4",
    ),
    ("params_bytes", edit(CONFIG, put("body.params.k", b"x")), "bytes is not a plain value"),
    ("params_nan", edit(CONFIG, put("body.params.lr", float("nan"))), "params.lr: nan is not finite"),
    ("layout_negative", edit(CONFIG, put("body.adapter_layout", [["a", [-1]]])), "dimension: -1 is outside"),
    ("layout_shape", edit(CONFIG, put("body.adapter_layout", [["a"]])), "expected [name, [dims...]]"),
    ("mask_without_shape", edit(CONFIG, put("body.mask_shape", None)), "both be nil or both be set"),
    ("class_mask_trailing", edit(CONFIG, put("body.class_masks.b", bytes([0, 0x80]))), "bits set beyond mask_shape"),
    ("limits_as_float", edit(CONFIG, put("body.limits.max_up", 1.5)), "limits.max_up: expected an integer"),
    ("label_not_in_classes", edit(PUBLIC, put("body.classes", [0])), "a label is not in classes"),
    (
        "public_length_mismatch",
        edit(PUBLIC, put("body.y", {"dt": "u2", "sh": [1], "b": u2(0)})),
        "2 samples but 1 labels",
    ),
    ("bad_participant", edit(SMALL[4], put("body.participants", ["a", "b c"])), "participants: 'b c'"),
    ("final_as_int", edit(SMALL[4], put("body.final", 1)), "final: expected a bool"),
    ("deadline_str", edit(SMALL[4], put("body.deadline", "soon")), "deadline: expected a number"),
    (
        "mixed_round_dtypes",
        edit(ROUND_Q8, put("body.params", {"dt": "f4", "sh": [1], "b": b"\0\0\0\0"})),
        "same wire dtype",
    ),
    ("correct_over_n", edit(METRICS, put("body.correct_test", 3)), "correct_test = 3 exceeds n_test = 2"),
    ("extra_inf", edit(METRICS, put("body.extra.norm", float("inf"))), "extra.norm: inf is not finite"),
    ("dense_update_2d", edit(SMALL[9], put("body.update.sh", [5, 1])), "expected 1 dimensions"),
]


# Cases that need a tighter decoder to trip.
LIMITS = {
    "oversize": Limits(max_message_bytes=64),
    "too_many_objects": Limits(max_objects=50),
    "string_over_limit": Limits(max_str_len=50),
    "list_over_limit": Limits(max_list_len=10),
    "sparse_n_over_limit": Limits(max_elements=4000),
}


def test_cases_are_distinct() -> None:
    assert len(CASES) >= 20
    assert len({c[0] for c in CASES}) == len(CASES)
    assert len({c[2] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("name,make,reason", CASES, ids=[c[0] for c in CASES])
def test_malformed(name: str, make: Callable[[], bytes], reason: str) -> None:
    with pytest.raises(WireError) as info:
        decode_message(make(), limits=LIMITS.get(name, DEFAULT_LIMITS))
    assert reason in str(info.value)


def test_body_errors_name_sender_and_round() -> None:
    with pytest.raises(WireError, match=r"\(sender rpi-07, round 3\)$"):
        decode_message(edit(PROTOS, put("body.n_samples", -1))())


# --- random input --------------------------------------------------------------------------------


def check(data: bytes) -> bool:
    """True if `data` decoded; a decoded message must also survive re-encoding (its invariants hold)."""
    try:
        env, msg = decode_message(data)
    except WireError as e:
        assert "bug in protofl.wire" not in str(e), str(e)
        return False
    assert isinstance(msg, MESSAGE_TYPES[env.kind])
    again = encode_message(msg, fed=env.fed, sender=env.sender, round=env.round, phase=env.phase, msg_id=env.msg_id)
    decode_message(again)
    return True


def test_random_bytes() -> None:
    rng = random.Random(1234)
    # Half start with a map header so the fuzz gets past the first byte more often.
    for i in range(10_000):
        body = rng.randbytes(rng.randrange(0, 120))
        check((bytes([0x88]) + body) if i % 2 else body)


def byte_mutation(rng: random.Random, seed: bytes) -> bytes:
    """`seed` with one byte set, one bit flipped, cut short, one byte inserted, or one byte deleted."""
    data = bytearray(seed)
    pos = rng.randrange(len(data))
    op = rng.randrange(5)
    if op == 0:
        data[pos] = rng.randrange(256)
    elif op == 1:
        data[pos] ^= 1 << rng.randrange(8)
    elif op == 2:
        del data[pos:]
    elif op == 3:
        data.insert(pos, rng.randrange(256))
    else:
        del data[pos]
    return bytes(data)


def byte_mutations(seed: int, messages: list[Any], n: int) -> Iterator[bytes]:
    """`n` byte mutations of the messages' encodings, in turn, from a generator seeded with `seed`."""
    rng = random.Random(seed)
    seeds = [valid(m) for m in messages]
    for i in range(n):
        yield byte_mutation(rng, seeds[i % len(seeds)])


def test_byte_mutations_of_valid_messages() -> None:
    decoded = sum(check(data) for data in byte_mutations(99, SMALL, 10_000))
    assert 0 < decoded < 10_000  # both outcomes happen, or the fuzz is not reaching anything


POOL: list[Any] = [
    None, True, False, 0, -1, 1, 7, 2**31, 2**32, 2**63, -(2**63), 2**64 - 1, 0.5, -0.0,
    float("nan"), float("inf"), "", "x", "f4", "q8", "u1", "mask", b"", b"\x00" * 4, [], [0], [-1, 2], [1, 1],
    {}, {"dt": "f4", "sh": [1], "b": b"\x00\x00\x80?"}, {"dt": "q8", "sh": [0], "b": b"", "scale": 1.0, "zero": 0.0},
    {"n": 3, "i": {"dt": "u2", "sh": [1], "b": b"\x02\x00"}, "v": {"dt": "f4", "sh": [1], "b": b"\x00\x00\x80?"}},
    {"c": {"dt": "u2", "sh": [0], "b": b""}, "v": {"dt": "f4", "sh": [0, 2], "b": b""}, "n": None},
]  # fmt: skip


def nodes(obj: Any, path: tuple = ()) -> list[tuple]:
    out = [path]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += nodes(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += nodes(v, path + (i,))
    return out


def tree_mutation(rng: random.Random, top: dict, path: tuple) -> bytes:
    """`top` (changed in place) with the value at `path` dropped (a map's, sometimes) or swapped for one of
    POOL's, packed."""
    parent = top
    for p in path[:-1]:
        parent = parent[p]
    if isinstance(parent, dict) and rng.random() < 0.15:
        del parent[path[-1]]
    else:
        parent[path[-1]] = copy.deepcopy(rng.choice(POOL))
    return msgpack.packb(top, use_bin_type=True)


def test_structural_mutations_of_valid_messages() -> None:
    """Swap one value anywhere in the tree for another msgpack value: reaches the body validators."""
    rng = random.Random(7)
    trees = [msgpack.unpackb(valid(m), raw=False) for m in SMALL]
    decoded = 0
    for i in range(4_000):
        top = copy.deepcopy(trees[i % len(trees)])
        # Mostly inside the body: the envelope is a small share of what a peer can get wrong.
        path = rng.choice(nodes(top["body"], ("body",))[1:] or [("body",)] if rng.random() < 0.85 else nodes(top)[1:])
        decoded += check(tree_mutation(rng, top, path))
    assert 0 < decoded < 4_000
