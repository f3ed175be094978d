"""Fixed-byte wire fixtures: every message kind and variant against bytes recorded once.

Round-trip tests pass when encoder and decoder change together; devices already in the field would
still break. Here each case in `wire_fixtures/cases.py` must (1) encode to exactly its recorded
`.msgpack` bytes and (2) decode from them back to itself, field by field and dtype by dtype, and
(3) every kind the codec knows must have a fixture. A failure means the wire format changed: revert
the change, or, for an intended change, bump `protofl.WIRE_VERSION` and re-record with
`python tests/protofl/wire_fixtures/record.py` (see its docstring).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from protofl import WIRE_VERSION
from protofl.wire import KINDS, MESSAGE_TYPES, decode_message, encode_message
from protofl.wire.codec import FLOAT_DTS
from tests.protofl.wire_fixtures.cases import CASES, Case

FIXTURES = Path(__file__).parent / "wire_fixtures"
RECORD = "python tests/protofl/wire_fixtures/record.py"


def stored(name: str) -> bytes:
    path = FIXTURES / f"{name}.msgpack"
    if not path.exists():
        pytest.fail(f"{path.name} is missing: a new case is recorded with `{RECORD} {name}`", pytrace=False)
    return path.read_bytes()


def _structure_diff(got: Any, want: Any, at: str = "") -> str | None:
    """The first place two unpacked msgpack trees differ, for a readable failure."""
    if type(got) is not type(want):
        return f"{at or 'top'}: {type(want).__name__} {want!r:.80} became {type(got).__name__} {got!r:.80}"
    if isinstance(want, dict):
        if list(got) != list(want):
            return f"{at or 'top'}: keys {list(want)} became {list(got)}"
        return next((d for k in want if (d := _structure_diff(got[k], want[k], f"{at}.{k}"))), None)
    if isinstance(want, list):
        if len(got) != len(want):
            return f"{at}: length {len(want)} became {len(got)}"
        return next(
            (d for i, (g, w) in enumerate(zip(got, want, strict=True)) if (d := _structure_diff(g, w, f"{at}[{i}]"))),
            None,
        )
    return None if got == want else f"{at}: {want!r:.80} became {got!r:.80}"


@pytest.mark.parametrize("name", list(CASES))
def test_encoding_is_the_recorded_bytes(name: str) -> None:
    want = stored(name)
    got = CASES[name].encode()
    if got != want:
        at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
        where = _structure_diff(msgpack.unpackb(got), msgpack.unpackb(want)) or "same structure, other bytes"
        pytest.fail(
            f"{name}: the encoding changed ({len(want)} -> {len(got)} bytes, first difference at byte {at}; "
            f"{where}). Devices in the field speak the recorded bytes: revert, or bump WIRE_VERSION and "
            f"re-record with `{RECORD}`.",
            pytrace=False,
        )


def assert_same(got: Any, want: Any, at: str) -> None:
    """Deep equality over dataclass fields; arrays must agree in dtype and shape as well as values."""
    assert type(got) is type(want), f"{at}: {type(want).__name__} decoded as {type(got).__name__}"
    if isinstance(want, np.ndarray):
        assert got.dtype == want.dtype, f"{at}: dtype {want.dtype} decoded as {got.dtype}"
        assert got.shape == want.shape, f"{at}: shape {want.shape} decoded as {got.shape}"
        assert np.array_equal(got, want), f"{at}: values {want!r} decoded as {got!r}"
    elif dataclasses.is_dataclass(want):  # messages, ProtoSet and SparseVector alike
        for f in dataclasses.fields(want):
            assert_same(getattr(got, f.name), getattr(want, f.name), f"{at}.{f.name}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{at}: {want!r} decoded as {got!r}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{at}[{i}]")
    elif isinstance(want, dict):
        assert list(got) == list(want), f"{at}: keys {list(want)} decoded as {list(got)}"
        for k in want:
            assert_same(got[k], want[k], f"{at}.{k}")
    else:
        assert got == want, f"{at}: {want!r} decoded as {got!r}"


@pytest.mark.parametrize("name", list(CASES))
def test_recorded_bytes_decode_to_the_case(name: str) -> None:
    case, data = CASES[name], stored(name)
    env, msg = decode_message(data)
    assert (env.v, env.kind, env.fed, env.round, env.phase, env.sender, env.msg_id) == (
        WIRE_VERSION,
        case.kind,
        case.fed,
        case.round,
        case.phase,
        case.sender,
        case.msg_id,
    )
    assert_same(msg, case.msg, name)
    # and what a receiver decoded, it sends on unchanged (nothing lost in decoding, e.g. a dtype)
    again = encode_message(msg, fed=env.fed, sender=env.sender, round=env.round, phase=env.phase, msg_id=env.msg_id)
    assert again == data, f"{name}: decoding and re-encoding the recorded bytes does not reproduce them"


def test_every_kind_the_codec_knows_has_a_fixture() -> None:
    kinds = set(KINDS) | set(MESSAGE_TYPES)  # the envelope's list and the message classes'
    missing = sorted(kinds - {case.kind for case in CASES.values()})
    assert not missing, f"no wire fixture for kind(s) {missing}: add cases to wire_fixtures/cases.py and record them"


def _float_dts(case: Case) -> set[str]:
    """The float wire dtypes a case's arrays travel in."""
    found: set[str] = set()

    def walk(obj: Any) -> None:
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # messages, ProtoSet, SparseVector
            dt = getattr(obj, "dt", None)
            if dt in FLOAT_DTS:
                found.add(dt)
            for f in dataclasses.fields(obj):
                walk(getattr(obj, f.name))

    walk(case.msg)
    return found


@pytest.mark.parametrize("kind", ["round", "protos", "adapter"])
def test_every_float_dtype_has_a_fixture(kind: str) -> None:
    """Where a message chooses its array dtype, each of f4, f2, q8 (read from the codec) has a fixture."""
    used = set().union(*(_float_dts(c) for c in CASES.values() if c.kind == kind))
    assert used >= FLOAT_DTS, f"{kind}: no fixture for wire dtype(s) {sorted(FLOAT_DTS - used)}"


def test_every_fixture_file_has_a_case() -> None:
    stale = sorted(p.name for p in FIXTURES.glob("*.msgpack") if p.stem not in CASES)
    assert not stale, f"fixtures without a case in cases.py: {stale} (`{RECORD}` without names deletes them)"
