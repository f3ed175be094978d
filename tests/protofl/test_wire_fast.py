"""The compiled upload reader (`protofl.wire.fast`) against the reference decoder: on every valid upload it
gives the reference's message, and it never accepts a message the reference refuses (it answers None and
the reference decides). The corpus is test_wire_fuzz's: its named malformed cases, its byte and structural
mutations of valid messages, and the cases a schema reader could get wrong (duplicate keys, names with a
newline, characters against bytes, limits tighter than the schema)."""

from __future__ import annotations

import copy
import random
from typing import Any

import msgpack
import numpy as np
import pytest

from protofl.errors import WireError
from protofl.sparse import SparseVector
from protofl.wire import DEFAULT_LIMITS, Limits, ParamsUpload, ProtoSet, ProtoUpload, decode_body, fast, read_header
from tests.protofl.test_wire_fuzz import (
    BY_INDEX,
    BY_MASK,
    CASES,
    LIMITS,
    PROTOS,
    SMALL,
    byte_mutations,
    nodes,
    tree_mutation,
    valid,
)

pytestmark = pytest.mark.skipif(not fast.available(), reason="msgspec (the `fast` extra) is not installed")

HEAD_FIELDS = ("v", "kind", "fed", "round", "phase", "sender", "msg_id")
UPLOADS = [
    PROTOS,
    ProtoUpload(None, ProtoSet(np.array([2]), np.ones((1, 3), np.float32), dt="f2"), 1),
    ProtoUpload(PROTOS.local, ProtoSet(np.array([0, 9]), np.full((2, 4), -2.5, np.float32)), 0),
    ProtoUpload(ProtoSet(np.zeros(0, np.int64), np.zeros((0, 4), np.float32)), None, 3),
    BY_INDEX,
    BY_MASK,
    ParamsUpload(SparseVector(100_000, np.arange(0, 100_000, 11), np.ones(9091, np.float32)), 7, 4, dt="f2"),
    ParamsUpload(np.linspace(-1, 1, 5, dtype=np.float32), 3, 1),
]


def reference(data: bytes, limits: Limits) -> Any:
    """What the server's reference path makes of `data`: (envelope fields, message), or the WireError."""
    try:
        head = read_header(data, limits)
        return tuple(getattr(head, k) for k in HEAD_FIELDS), decode_body(head.open(), limits)
    except WireError as exc:
        return exc


def agrees(data: bytes, limits: Limits = DEFAULT_LIMITS) -> bool:
    """Check the contract on `data`; True if the fast reader decided (read it), False if it left it."""
    ref = reference(data, limits)
    got = fast.read_upload(data, limits)
    if got is None:
        return False
    assert not isinstance(ref, WireError), f"fast reader accepted what the reference refuses: {ref}"
    head, msg = got
    assert tuple(getattr(head, k) for k in HEAD_FIELDS) == ref[0]
    assert msg == ref[1] and type(msg) is type(ref[1])
    for a, b in _arrays(msg, ref[1]):
        assert a.dtype == b.dtype and a.flags.writeable == b.flags.writeable
    assert getattr(msg, "dt", None) == getattr(ref[1], "dt", None)
    return True


def _arrays(a: Any, b: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    if isinstance(a, ProtoUpload):
        return [
            pair
            for x, y in ((a.local, b.local), (a.public, b.public))
            if x is not None
            for pair in ((x.classes, y.classes), (x.values, y.values))
            + (((x.counts, y.counts),) if x.counts is not None else ())
        ]
    u, w = a.update, b.update
    return [(u.indices, w.indices), (u.values, w.values)] if isinstance(u, SparseVector) else [(u, w)]


@pytest.mark.parametrize("msg", UPLOADS, ids=lambda m: type(m).__name__)
def test_every_valid_upload_form_is_read_as_the_reference_reads_it(msg: Any) -> None:
    assert agrees(valid(msg))


def test_a_big_endian_host_reads_the_classes_through_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    # The classes are read by the memoryview on little-endian hosts; the other path is numpy's, tried here.
    monkeypatch.setattr(fast, "_LITTLE", False)
    assert all(agrees(valid(msg)) for msg in UPLOADS if isinstance(msg, ProtoUpload))


def test_what_the_schema_does_not_know_is_left_to_the_reference() -> None:
    q8 = ParamsUpload(np.linspace(-1, 1, 6, dtype=np.float32), 3, 1, dt="q8")
    for msg in [q8] + [m for m in SMALL if not isinstance(m, (ProtoUpload, ParamsUpload))]:
        data = valid(msg)
        assert not isinstance(reference(data, DEFAULT_LIMITS), WireError)
        assert fast.read_upload(data) is None, type(msg).__name__
    assert fast.read_upload(bytearray(valid(PROTOS))) is None  # only bytes: what a transport hands over


@pytest.mark.parametrize("name,make,reason", CASES, ids=[c[0] for c in CASES])
def test_named_malformed_cases_are_never_read(name: str, make: Any, reason: str) -> None:
    limits = LIMITS.get(name, DEFAULT_LIMITS)
    assert fast.read_upload(make(), limits) is None
    assert isinstance(reference(make(), limits), WireError)


def _pack_map(pairs: list[tuple[Any, Any]]) -> bytes:
    """A msgpack map with these pairs in this order, duplicates kept (msgpack.packb would merge them)."""
    out = bytearray(b"\xde" + len(pairs).to_bytes(2, "big"))
    for k, v in pairs:
        out += msgpack.packb(k, use_bin_type=True) + msgpack.packb(v, use_bin_type=True)
    return bytes(out)


def _top(msg: Any) -> dict:
    return msgpack.unpackb(valid(msg), raw=False)


def test_the_cases_a_schema_reader_could_get_wrong() -> None:
    top = _top(PROTOS)
    pairs = list(top.items())
    cases = {
        "duplicate kind, the later a join": _pack_map(pairs + [("kind", "join")]),
        "duplicate kind, the earlier a join": _pack_map([("kind", "join")] + pairs),
        "duplicate body, the later empty": _pack_map(pairs + [("body", {})]),
        "duplicate round, the later stale": _pack_map(pairs + [("round", 1)]),
        "sender with a newline": msgpack.packb({**top, "sender": "rpi-07\n"}, use_bin_type=True),
        "fed with a newline first": msgpack.packb({**top, "fed": "\nfed"}, use_bin_type=True),
        "msg_id of 64 two-byte characters": msgpack.packb({**top, "msg_id": "é" * 64}, use_bin_type=True),
        "msg_id of 65 two-byte characters": msgpack.packb({**top, "msg_id": "é" * 65}, use_bin_type=True),
        "version true": msgpack.packb({**top, "v": True}, use_bin_type=True),
        "version 1.0": msgpack.packb({**top, "v": 1.0}, use_bin_type=True),
        "round 3.0": msgpack.packb({**top, "round": 3.0}, use_bin_type=True),
        "n_samples 2**63": msgpack.packb({**top, "body": {**top["body"], "n_samples": 2**63}}, use_bin_type=True),
        "kind as bytes": msgpack.packb({**top, "kind": b"protos"}, use_bin_type=True),
        "phase as bytes": msgpack.packb({**top, "phase": b"train"}, use_bin_type=True),
        "body key as bytes": _pack_map([(k, v) for k, v in pairs if k != "body"] + [(b"body", top["body"])]),
    }
    read = {name: agrees(data) for name, data in cases.items()}
    assert read["msg_id of 64 two-byte characters"]  # characters, as the reference counts them
    assert not read["msg_id of 65 two-byte characters"]
    # Duplicate keys: msgpack keeps the later value, and so must the fast reader if it reads the message.
    assert not read["duplicate kind, the later a join"]


def test_sparse_and_dense_keys_are_not_mixed() -> None:
    dense = _top(UPLOADS[-1])
    sparse = _top(BY_INDEX)
    mixed = [
        {**dense["body"]["update"], "n": 5},
        {**sparse["body"]["update"], "dt": "f4"},
        {**sparse["body"]["update"], "mask": {"dt": "u1", "sh": [125], "b": bytes(125)}},
        {k: v for k, v in sparse["body"]["update"].items() if k != "i"},
        {k: v for k, v in dense["body"]["update"].items() if k != "b"},
    ]
    for i, update in enumerate(mixed):
        top = copy.deepcopy(sparse if "n" in update else dense)
        top["body"]["update"] = update
        data = msgpack.packb(top, use_bin_type=True)
        assert isinstance(reference(data, DEFAULT_LIMITS), WireError), i
        assert fast.read_upload(data) is None, i


def test_limits_below_the_schemas_bounds_leave_every_upload_to_the_reference() -> None:
    assert fast.usable(DEFAULT_LIMITS)
    for tight in (
        Limits(max_objects=50),
        Limits(max_str_len=20),
        Limits(max_list_len=4),
        Limits(max_map_len=6),
        Limits(max_bin_len=1000),
    ):
        assert not fast.usable(tight), tight
    small = Limits(max_message_bytes=64)
    assert fast.read_upload(valid(PROTOS), small) is None
    assert isinstance(reference(valid(PROTOS), small), WireError)


def test_byte_mutations_of_valid_uploads() -> None:
    read = sum(agrees(data) for data in byte_mutations(2027, UPLOADS, 6_000))
    assert 0 < read < 6_000


def test_structural_mutations_of_valid_uploads() -> None:
    """One value anywhere in an upload's tree swapped for another msgpack value, or a key dropped."""
    rng = random.Random(11)
    trees = [_top(m) for m in UPLOADS]
    read = 0
    for i in range(6_000):
        top = copy.deepcopy(trees[i % len(trees)])
        read += agrees(tree_mutation(rng, top, rng.choice(nodes(top)[1:])))
    assert 0 < read < 6_000
