"""The compiled reader of the two upload kinds (protos, adapter): the aggregator's hot path (issue 27).

An aggregator spends most of an upload's time checking the structure of maps in Python (`read_header`, then
`Header.open` and the message's `from_body`: ~80 us of a 2 KB prototype upload). Here the same structure is
declared once as msgspec schemas and checked while the bytes are parsed, in C (~4 us); the values (shapes,
byte counts, finiteness, class order, sparse indices) are then checked as the reference decoder checks them:
written out here for the shapes uploads have (a prototype set, a sparse update's values and packed mask),
by the reference's own functions for the rest (`array_from_parts`, `sparse_from_parts`, `_decoded`).

The contract: `read_upload` returns what the reference decoder returns (`read_header` + `decode_body`) for a
message the reference accepts, or None, and then the caller asks the reference decoder, whose WireError
names what was wrong. It never accepts what the reference refuses: anything this schema does not know (a q8
upload, a key it does not expect, a value of another type, a limit tighter than the schema's bounds) is None.
tests/protofl/test_wire_fast.py holds the two to that on valid uploads of every form and on their mutations.

msgspec is the `fast` extra (`pip install 'protofl-edge[fast]'`): a server without it reads every upload with
the reference decoder, the same results at about half the rate. Devices never need it.
"""

from __future__ import annotations

import math
import sys
from typing import Annotated, Any, Literal

import numpy as np

from protofl import WIRE_VERSION
from protofl.errors import WireError
from protofl.names import NAME_PATTERN
from protofl.sparse import SparseVector
from protofl.wire.codec import (
    DEFAULT_LIMITS,
    MAX_NDIM,
    MAX_ROUND,
    MAX_SPARSE_N,
    Head,
    Limits,
    _built,
    array_from_parts,
    sparse_from_parts,
)
from protofl.wire.messages import ParamsUpload, ProtoSet, ProtoUpload

try:
    import msgspec
    from msgspec import UNSET, Meta, Struct, UnsetType
except ImportError:  # the `fast` extra is not installed: every upload takes the reference decoder
    msgspec = None  # type: ignore[assignment]

# The most objects a body this schema accepts can hold, as the reference decoder counts them (a map or list
# counts its entries plus one): a prototype body is its map (4), two sets (4 each) of three arrays (a map of 4
# and a shape of at most MAX_NDIM + 1). A `Limits` whose budget, string, list or map bounds are below what
# the schema lets through is left to the reference decoder (`usable`).
_ARRAY_OBJECTS = 4 + MAX_NDIM + 1
_BODY_OBJECTS = {"protos": 4 + 2 * (4 + 3 * _ARRAY_OBJECTS), "adapter": 4 + 4 + 2 * _ARRAY_OBJECTS}
_LONGEST_STR = 4 * 64  # bytes (msgpack's measure): msg_id's 64 characters in UTF-8; names are ASCII
_LONGEST_MAP = 8  # the envelope


def available() -> bool:
    """Whether msgspec is installed (the `fast` extra)."""
    return msgspec is not None


def usable(limits: Limits) -> bool:
    """Whether this reader can decide for `limits`: msgspec is there and no limit is below the schema's bounds."""
    return (
        msgspec is not None
        and limits.max_str_len >= _LONGEST_STR
        and limits.max_map_len >= _LONGEST_MAP
        and limits.max_list_len >= MAX_NDIM
        and limits.max_bin_len >= limits.max_message_bytes
        and all(limits.max_body_objects(k) >= n for k, n in _BODY_OBJECTS.items())
    )


if msgspec is not None:
    _Name = Annotated[str, Meta(pattern=f"^(?:{NAME_PATTERN.pattern})\\Z")]  # re.search: `$` would pass "x\n"
    _Count = Annotated[int, Meta(ge=0, le=2**63 - 1)]

    # gc=False: these hold strings, views of bytes, ints and lists of ints, never a cycle, so the collector need not
    # track the ~10 objects each upload makes.
    class _Array(Struct, forbid_unknown_fields=True, gc=False):
        """An array map {dt, sh, b} (q8 adds scale and zero: unknown here, so a q8 upload reads slowly). `b` is a
        view of the message's bytes (msgspec's zero-copy bin): the arrays built from it are copies or die first."""

        dt: str
        sh: list[int]
        b: memoryview

    class _ProtoSet(Struct, forbid_unknown_fields=True, gc=False):
        c: _Array
        v: _Array
        n: _Array | None

    class _ProtosBody(Struct, forbid_unknown_fields=True, gc=False):
        local: _ProtoSet | None
        public: _ProtoSet | None
        n_samples: _Count

    class _Update(Struct, forbid_unknown_fields=True, gc=False):
        """A dense array map {dt, sh, b} or a sparse vector {n, i or mask, v}: the keys present decide."""

        dt: str | UnsetType = UNSET
        sh: list[int] | UnsetType = UNSET
        b: memoryview | UnsetType = UNSET
        n: Annotated[int, Meta(ge=0, le=MAX_SPARSE_N - 1)] | UnsetType = UNSET
        i: _Array | UnsetType = UNSET
        mask: _Array | UnsetType = UNSET
        v: _Array | UnsetType = UNSET

    class _AdapterBody(Struct, forbid_unknown_fields=True, gc=False):
        update: _Update
        n_samples: _Count
        base_round: Annotated[int, Meta(ge=0, le=2**31 - 1)]

    class _Envelope(Struct, forbid_unknown_fields=True, tag_field="kind", gc=False):
        v: int
        fed: _Name
        round: Annotated[int, Meta(ge=0, le=MAX_ROUND - 1)]
        phase: Literal["", "proto", "train", "done"]
        sender: _Name
        msg_id: Annotated[str, Meta(max_length=64)]

    class _Protos(_Envelope, tag="protos"):
        body: _ProtosBody

    class _Adapter(_Envelope, tag="adapter"):
        body: _AdapterBody

    _DECODER = msgspec.msgpack.Decoder(_Protos | _Adapter)


def read_upload(data: Any, limits: Limits = DEFAULT_LIMITS) -> tuple[Head, ProtoUpload | ParamsUpload] | None:
    """A prototype or adapter upload as the reference decoder reads it (its envelope's fields, its message),
    or None where the reference decoder must decide (another kind, a q8 upload, anything invalid)."""
    if type(data) is not bytes or len(data) > limits.max_message_bytes:
        return None
    try:
        env = _DECODER.decode(data)
        # isinstance, not `type(env) is`: mypy narrows env.body only through isinstance (msgspec 0.23's stubs)
        if isinstance(env, _Protos):
            if env.v != WIRE_VERSION or len(data) > limits.max_bytes("protos"):
                return None
            msg: ProtoUpload | ParamsUpload = _protos(env.body, limits)
        else:
            if env.v != WIRE_VERSION or len(data) > limits.max_bytes("adapter"):
                return None
            msg = _adapter(env.body, limits)
    except Exception:  # invalid (msgspec's errors, WireError, RecursionError on deep nesting) or unforeseen: the
        return None  # reference decoder decides, and names what is wrong
    head = _built(
        Head,
        {
            "v": env.v,
            "kind": msg.KIND,
            "fed": env.fed,
            "round": env.round,
            "phase": env.phase,
            "sender": env.sender,
            "msg_id": env.msg_id,
        },
    )
    return head, msg


# The errors raised here are never shown (the reference decoder reads the message again and names what is wrong),
# so they carry no text worth building per upload.
_WHAT = "upload"


def _array(a: _Array, dts: frozenset[str] | tuple[str, ...], ndim: int, limits: Limits) -> np.ndarray:
    if a.dt not in dts:
        raise WireError(_WHAT)
    return array_from_parts(a.dt, a.sh, a.b.tobytes(), what=_WHAT, limits=limits, ndim=ndim)


_FLOATS = ("f4", "f2")  # q8 never reaches here: its extra keys fail the schema
_FLOAT_DTYPES: dict[str, np.dtype] = {"f4": np.dtype("<f4"), "f2": np.dtype("<f2")}
_U2, _U4 = np.dtype("<u2"), np.dtype("<u4")
_LITTLE = sys.byteorder == "little"


def _set(ps: _ProtoSet | None, limits: Limits) -> ProtoSet | None:
    """A prototype set as `ProtoSet.from_body` builds it, its checks written out for the one shape a set has
    (values (k, w) f4 or f2, classes (k,) u2, counts (k,) u4): `array_from_parts` per array, its generic shape
    loop and dtype lookups included, was a fifth of an upload's time (issue 27)."""
    if ps is None:
        return None
    c, v, n = ps.c, ps.v, ps.n
    if c.dt != "u2" or len(v.sh) != 2 or len(c.sh) != 1:
        raise WireError(_WHAT)
    k, w = v.sh
    top = limits.max_elements  # `_shape`: dimensions non-negative, each and their product within the limit
    if not (0 <= k <= top and 0 <= w <= top and k * w <= top) or c.sh[0] != k or len(c.b) != 2 * k:
        raise WireError(_WHAT)
    # Each numpy call costs ~2 us in the aggregator's loop (measured), so few are made: the classes are read by
    # the memoryview itself (u2 is little-endian, as the host, or else numpy reads them) and their order is
    # checked on a Python list (faster than numpy at ~10 classes).
    order = c.b.cast("H").tolist() if _LITTLE else np.frombuffer(c.b, _U2).tolist()
    if order != sorted(set(order)):  # ascending without repeats
        raise WireError(_WHAT)
    values = _floats(v, (k, w))
    counts = None
    if n is not None:
        if n.dt != "u4" or n.sh != [k] or len(n.b) != 4 * k:
            raise WireError(_WHAT)
        counts = np.frombuffer(n.b, _U4).astype(np.int64)
        if k and not counts.min() >= 1:
            raise WireError(_WHAT)
    return ProtoSet._trusted(np.array(order, dtype=np.int64), values, counts, v.dt)


def _protos(body: _ProtosBody, limits: Limits) -> ProtoUpload:
    # n_samples: the schema's _Count is `expect_int`'s range
    return ProtoUpload._trusted(_set(body.local, limits), _set(body.public, limits), body.n_samples)


def _adapter(body: _AdapterBody, limits: Limits) -> ParamsUpload:
    u = body.update
    if u.n is UNSET:  # dense: exactly dt, sh, b
        if u.dt is UNSET or u.sh is UNSET or u.b is UNSET or not (u.i is u.mask is u.v is UNSET) or u.dt not in _FLOATS:
            raise WireError(_WHAT)
        update: SparseVector | np.ndarray = array_from_parts(
            u.dt, u.sh, u.b.tobytes(), what=_WHAT, limits=limits, ndim=1
        )
        dt = u.dt
    else:  # sparse: exactly n, v and one of i / mask
        if (
            not (u.dt is u.sh is u.b is UNSET)
            or u.v is UNSET
            or (u.i is UNSET) == (u.mask is UNSET)
            or u.n > limits.max_elements
        ):
            raise WireError(_WHAT)
        values = _values(u.v, limits)
        if u.i is not UNSET:
            update = sparse_from_parts(u.n, _array(u.i, ("u2", "u4"), 1, limits), None, values, _WHAT)
        else:
            mask = u.mask
            assert not isinstance(mask, UnsetType)
            if mask.dt != "u1" or mask.sh != [len(mask.b)] or len(mask.b) > limits.max_elements:
                raise WireError(_WHAT)
            # The packed bytes as they arrived (no copy): only their set positions outlive this call.
            update = sparse_from_parts(u.n, None, np.frombuffer(mask.b, np.uint8), values, _WHAT)
        dt = u.v.dt
    return ParamsUpload._decoded(update, dt, body.n_samples, body.base_round)


def _values(a: _Array, limits: Limits) -> np.ndarray:
    """A sparse update's values, 1-D f4 or f2, as `array_from_parts` gives them (float32, finite, a copy)."""
    if len(a.sh) != 1 or not 0 <= a.sh[0] <= limits.max_elements:
        raise WireError(_WHAT)
    return _floats(a, (a.sh[0],))


def _floats(a: _Array, shape: tuple[int, ...]) -> np.ndarray:
    """Array `a` (f4 or f2) of `shape` (the caller checked it against the limits) as float32, finite, a copy.
    Finiteness by counting: `.all()` goes through numpy's generic reduction (~3 us more per upload in the
    aggregator's loop, measured), count_nonzero over bools does not."""
    dt = _FLOAT_DTYPES.get(a.dt)
    if dt is None or len(a.b) != math.prod(shape) * dt.itemsize:
        raise WireError(_WHAT)
    values = np.ndarray(shape, dt, a.b).astype(np.float32)
    if int(np.count_nonzero(np.isfinite(values))) != values.size:
        raise WireError(_WHAT)
    return values
