"""Wire codec, version 1: arrays, sparse vectors and the envelope, as msgpack with strict validation.

Everything a peer sends is untrusted. Decoding checks types, shapes, byte counts, ranges and finiteness,
and every failure raises one `WireError` whose message names the field and the reason, so the receiver
can log it and drop the message without changing state. Encoding rejects a sender's own bad input
(NaN, out-of-range integers) with `ValueError`.

What a hostile peer can make a receiver spend is bounded: `read_header` parses the envelope and skips
the body without building it, so kind, sender, federation, round and the size limit of the kind are
checked first; `Header.open` parses the body within an object budget of its kind; every check is
linear in what it checks.

Arrays travel as `{"dt", "sh", "b"}` (little-endian bytes, C order); q8 adds `"scale"` and `"zero"`:
x ~ (q - zero) * scale with `zero` a float (not rounded to an integer, so every input lies within
scale/2 of a grid point). Constant and empty arrays use q = 0, scale = 1, zero = -value, which
reproduces the value exactly; a decoder therefore requires scale finite and > 0, always.
Sparse vectors travel as `{"n", "i", "v"}` or `{"n", "mask", "v"}`; the mask is np.packbits with
bitorder="little" (bit j of byte k is coordinate 8k + j), exactly ceil(n / 8) bytes, unused high
bits of the last byte zero.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgpack
import numpy as np

from protofl import WIRE_VERSION
from protofl.errors import WireError
from protofl.names import is_valid_name
from protofl.sparse import SparseVector

KiB = 2**10
MiB = 2**20


# The kinds with a limit of their own below max_message_bytes, and the field that holds it.
_SMALL_KINDS = {
    "join": "max_join_bytes",
    "status": "max_status_bytes",
    "metrics": "max_metrics_bytes",
    "resend": "max_status_bytes",
    "pace": "max_status_bytes",
}


@dataclass(frozen=True)
class Limits:
    """Decoder limits; a federation may tighten them (constrained links) or loosen them (big models)."""

    max_message_bytes: int = 32 * MiB
    max_elements: int = 16 * MiB  # per array, and the dense length of a sparse vector
    max_list_len: int = 100_000
    max_map_len: int = 4096
    max_str_len: int = 1 * MiB
    max_bin_len: int = 64 * MiB
    # Containers plus their elements in one message: 32 MiB of nested empty maps would otherwise
    # expand to gigabytes of Python objects before any validation runs.
    max_objects: int = 1_000_000
    # Kinds small by nature, refused by their size as soon as the envelope names the kind, before the
    # body is parsed: a member cannot make the receiver parse megabytes that cannot be a join, a status
    # or a device's metrics. A simulation raises `max_metrics_bytes` for the class probabilities its
    # devices send on the test set (`Metrics.probs`); devices in the field send none.
    max_join_bytes: int = 64 * KiB
    max_status_bytes: int = 64 * KiB
    max_metrics_bytes: int = 64 * KiB

    def max_bytes(self, kind: str) -> int:
        """The largest message of `kind` this decoder reads."""
        small = _SMALL_KINDS.get(kind)  # (asked for every upload: no dict of the limits built per call)
        return self.max_message_bytes if small is None else min(self.max_message_bytes, getattr(self, small))

    def max_body_objects(self, kind: str) -> int:
        """The most msgpack objects (containers plus their elements) a body of `kind` may hold.

        A device's kinds are a few fixed maps of arrays (a valid join has 6 objects, an upload under 40,
        metrics 20 plus its `extra` map), so a body with more is refused while it is parsed, after a few
        hundred objects rather than `max_objects`: a body of a million empty lists costs a receiver
        about a second of parsing before any validation could refuse it. The server's kinds (config,
        public, round) carry lists whose length the federation sets, and keep `max_objects`."""
        fixed = {
            "join": 64,
            "status": 64,
            "resend": 64,
            "protos": 256,
            "adapter": 256,
            "metrics": 64 + self.max_map_len,
            # secure aggregation: a few byte strings, or one array
            "sa_keys": 64,
            "sa_masked": 64,
            "sa_shares2": 64,
            "sa_unmask2": 64,
        }
        return min(self.max_objects, fixed.get(kind, self.max_objects))


DEFAULT_LIMITS = Limits()

_DTYPES: dict[str, np.dtype] = {
    "f4": np.dtype("<f4"),
    "f2": np.dtype("<f2"),
    "q8": np.dtype("u1"),
    "u1": np.dtype("u1"),
    "u2": np.dtype("<u2"),
    "u4": np.dtype("<u4"),
}
_NATIVE = {k: v.newbyteorder("=") for k, v in _DTYPES.items()}
FLOAT_DTS = frozenset({"f4", "f2", "q8"})
UINT_DTS = frozenset({"u1", "u2", "u4"})
MAX_NDIM = 8
MAX_NEIGHBOURS = 1024  # secure aggregation: neighbours of one device (2 ceil(log2 n): 28 at 10,000 devices)
MAX_SPARSE_N = 2**32
# "resend" (the server asks one device, on its own `down/{client_id}` topic, to send again what the broker
# dropped) is additive within version 1: a device that does not know it never subscribes to that topic.
# "pace" (the server tells one device, on its `down/` topic, when to come back: issue 47) is additive the same way.
# The secure-aggregation kinds ("sa_...": protofl/secagg.py, issue 46) are additive the same way: a device sends
# them only in a federation whose config asks for secure aggregation, and the server sends them only to those.
# Five of them have a second form ("...2": no ids after the roster, 32-byte shares; messages.py says why); the
# first forms are retired, refused as unknown kinds.
SECAGG_DEVICE_KINDS = frozenset({"sa_keys", "sa_shares2", "sa_masked", "sa_unmask2"})
SECAGG_SERVER_KINDS = frozenset({"sa_roster2", "sa_routed2", "sa_survivors2"})
KINDS = frozenset(
    {"join", "config", "public", "round", "protos", "adapter", "metrics", "status", "resend", "pace"}
    | SECAGG_DEVICE_KINDS
    | SECAGG_SERVER_KINDS
)
# What a device sends on its `up/{client_id}` topic (its status goes to `presence/{client_id}`): a
# receiver of `up/` refuses any other kind from the header, before the body is parsed.
DEVICE_KINDS = frozenset({"join", "protos", "adapter", "metrics"} | SECAGG_DEVICE_KINDS)
PHASES = frozenset({"", "proto", "train", "done"})
ENVELOPE_KEYS = ("v", "kind", "fed", "round", "phase", "sender", "msg_id", "body")
MAX_ROUND = 2**31


# --- validation primitives (shared with messages.py) -------------------------------------------


def _tname(v: Any) -> str:
    return "nil" if v is None else type(v).__name__


def expect_keys(obj: Any, keys: Collection[str], what: str) -> dict:
    """`obj` must be a map with exactly `keys` (all string keys)."""
    if not isinstance(obj, dict):
        raise WireError(f"{what}: expected a map, got {_tname(obj)}")
    for k in obj:
        if not isinstance(k, str):
            raise WireError(f"{what}: map key {k!r} is not a string")
    missing = [k for k in keys if k not in obj]
    if missing:
        raise WireError(f"{what}: missing key {missing[0]!r}")
    if len(obj) > len(keys):  # every key is present, so some are extra: name the first in sort order
        known = frozenset(keys)  # one set: the scan stays linear in the map, whatever the key count
        extra = min(k for k in obj if k not in known)
        raise WireError(f"{what}: unknown key {extra!r} (expected {', '.join(keys)})")
    return obj


def expect_int(v: Any, what: str, lo: int = 0, hi: int = 2**63 - 1) -> int:
    """An int in [lo, hi]; bools are not ints."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise WireError(f"{what}: expected an integer, got {_tname(v)}")
    v = int(v)
    if not lo <= v <= hi:
        raise WireError(f"{what}: {v} is outside [{lo}, {hi}]")
    return v


def expect_float(v: Any, what: str, lo: float = -math.inf) -> float:
    """A finite float >= lo. Ints are accepted (some encoders write 2.0 as 2); bools are not."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise WireError(f"{what}: expected a number, got {_tname(v)}")
    try:
        f = float(v)
    except OverflowError:
        raise WireError(f"{what}: {v} does not fit a float") from None
    if not math.isfinite(f):
        raise WireError(f"{what}: {f} is not finite")
    if f < lo:
        raise WireError(f"{what}: {f} is below {lo}")
    return f


def expect_str(v: Any, what: str, max_len: int | None = None) -> str:
    if not isinstance(v, str):
        raise WireError(f"{what}: expected a string, got {_tname(v)}")
    if max_len is not None and len(v) > max_len:
        raise WireError(f"{what}: {len(v)} characters, over the limit of {max_len}")
    return v


def expect_bool(v: Any, what: str) -> bool:
    if not isinstance(v, (bool, np.bool_)):
        raise WireError(f"{what}: expected a bool, got {_tname(v)}")
    return bool(v)


def expect_name(v: Any, what: str) -> str:
    """A federation or client id: what topics are built from, so no '/', '+', '#' or spaces."""
    if not isinstance(v, str):
        raise WireError(f"{what}: expected a string, got {_tname(v)}")
    if not is_valid_name(v):
        raise WireError(f"{what}: {v[:80]!r} is not a valid name (1-64 of A-Z a-z 0-9 _ . -)")
    return v


# --- dense arrays --------------------------------------------------------------------------------


def encode_array(a: np.ndarray, dt: str = "f4") -> dict:
    """Encode `a` as a wire array with dtype code `dt`; raise ValueError on input the code cannot hold."""
    if dt not in _DTYPES:
        raise ValueError(f"unknown wire dtype {dt!r}; known: {', '.join(_DTYPES)}")
    a = np.asarray(a)
    if a.dtype == np.bool_:
        raise ValueError("bool arrays do not travel as-is: pack them with np.packbits first (u1)")
    if a.ndim > MAX_NDIM:
        raise ValueError(f"array has {a.ndim} dimensions; the wire allows {MAX_NDIM}")
    sh = [int(d) for d in a.shape]
    if dt in UINT_DTS:
        if not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"dtype {dt} takes integer arrays, got {a.dtype}")
        top = int(np.iinfo(_DTYPES[dt]).max)
        if a.size and (int(a.min()) < 0 or int(a.max()) > top):
            raise ValueError(f"values outside [0, {top}] do not fit {dt}")
        return {"dt": dt, "sh": sh, "b": a.astype(_DTYPES[dt]).tobytes()}
    if not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)):
        raise ValueError(f"dtype {dt} takes numeric arrays, got {a.dtype}")
    with np.errstate(over="ignore", invalid="ignore"):
        x = a.astype(np.float32)
    if not np.isfinite(x).all():
        raise ValueError("array has NaN, inf, or values beyond float32 range; fix the sender")
    if dt == "q8":
        return _encode_q8(x, sh)
    with np.errstate(over="ignore"):
        raw = x.astype(_DTYPES[dt])
    if dt == "f2" and not np.isfinite(raw).all():
        raise ValueError("values beyond the float16 range (+-65504); send f4 or q8 instead")
    return {"dt": dt, "sh": sh, "b": raw.tobytes()}


def _encode_q8(x: np.ndarray, sh: list[int]) -> dict:
    x64 = x.astype(np.float64)
    lo = float(x64.min()) if x.size else 0.0
    hi = float(x64.max()) if x.size else 0.0
    if hi == lo:
        # q = 0 with zero = -value decodes to the value exactly, and scale stays > 0.
        scale, zero = 1.0, -lo
        q = np.zeros(x.shape, dtype=np.uint8)
    else:
        scale = (hi - lo) / 255.0
        zero = -lo / scale
        q = np.clip(np.rint((x64 - lo) / scale), 0, 255).astype(np.uint8)
    return {"dt": "q8", "sh": sh, "b": q.tobytes(), "scale": scale, "zero": zero}


def decode_array(
    obj: Any,
    *,
    what: str,
    limits: Limits = DEFAULT_LIMITS,
    dts: Collection[str] | None = None,
    ndim: int | None = None,
) -> np.ndarray:
    """Validate and decode a wire array: float codes give float32, u codes their unsigned dtype."""
    if not isinstance(obj, dict):
        raise WireError(f"{what}: expected an array map, got {_tname(obj)}")
    if "dt" not in obj:
        raise WireError(f"{what}: missing key 'dt'")
    dt = obj["dt"]
    if not isinstance(dt, str) or dt not in _DTYPES:
        raise WireError(f"{what}: unknown dtype {dt!r}; known: {', '.join(_DTYPES)}")
    if dts is not None and dt not in dts:
        raise WireError(f"{what}: dtype {dt} not allowed here; expected {' or '.join(sorted(dts))}")
    expect_keys(obj, ("dt", "sh", "b", "scale", "zero") if dt == "q8" else ("dt", "sh", "b"), what)
    return array_from_parts(
        dt, obj["sh"], obj["b"], what=what, limits=limits, ndim=ndim, scale=obj.get("scale"), zero=obj.get("zero")
    )


def array_from_parts(
    dt: str,
    sh: Any,
    b: Any,
    *,
    what: str,
    limits: Limits = DEFAULT_LIMITS,
    ndim: int | None = None,
    scale: Any = None,
    zero: Any = None,
) -> np.ndarray:
    """`decode_array` once the map's keys are checked (`dt` a known code): shape, byte count, values. The
    compiled upload decoder (`protofl.wire.fast`) checks the map with its schema and the values here."""
    sh = _shape(sh, what, limits, ndim)
    if not isinstance(b, bytes):
        raise WireError(f"{what}: 'b' must be bin bytes, got {_tname(b)}")
    need = math.prod(sh) * _DTYPES[dt].itemsize
    if len(b) != need:
        raise WireError(f"{what}: shape {sh} needs {need} bytes, got {len(b)}")
    raw = np.frombuffer(b, dtype=_DTYPES[dt]).reshape(sh)
    if dt in UINT_DTS:
        return raw.astype(_NATIVE[dt])
    if dt == "q8":
        scale = expect_float(scale, f"{what} q8 scale")
        zero = expect_float(zero, f"{what} q8 zero")
        if scale <= 0:
            raise WireError(f"{what}: q8 scale must be > 0, got {scale}")
        with np.errstate(over="ignore", invalid="ignore"):
            out = ((raw.astype(np.float64) - zero) * scale).astype(np.float32)
    else:
        out = raw.astype(np.float32)  # f4 and f2 convert exactly (no overflow to silence: errstate costs ~1 us)
    # isfinite().all() first: locating the bad index costs a nonzero() we only pay on failure.
    if not np.isfinite(out).all():
        bad = np.flatnonzero(~np.isfinite(out))
        raise WireError(f"{what}: non-finite value (NaN or inf) at flat index {int(bad[0])}")
    return out


def _shape(sh: Any, what: str, limits: Limits, ndim: int | None) -> list[int]:
    if not isinstance(sh, list):
        raise WireError(f"{what}: shape must be a list, got {_tname(sh)}")
    if len(sh) > MAX_NDIM:
        raise WireError(f"{what}: shape has {len(sh)} dimensions; the wire allows {MAX_NDIM}")
    if ndim is not None and len(sh) != ndim:
        raise WireError(f"{what}: expected {ndim} dimensions, got shape {sh}")
    for d in sh:
        if isinstance(d, bool) or not isinstance(d, int):
            raise WireError(f"{what}: shape {sh} has a non-integer dimension")
        if d < 0:
            raise WireError(f"{what}: shape {sh} has a negative dimension")
        if d > limits.max_elements:
            raise WireError(f"{what}: dimension {d} exceeds the element limit {limits.max_elements}")
    if math.prod(sh) > limits.max_elements:
        raise WireError(f"{what}: shape {sh} has {math.prod(sh)} elements, over the limit {limits.max_elements}")
    return sh


# --- sparse vectors ------------------------------------------------------------------------------


def check_sparse(sv: SparseVector) -> tuple[int, np.ndarray]:
    n = sv.n
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or not 0 <= n < MAX_SPARSE_N:
        raise ValueError(f"sparse vector length {n!r} must be an int in [0, 2**32)")
    idx = np.asarray(sv.indices)
    if idx.size and not np.issubdtype(idx.dtype, np.integer):
        raise ValueError(f"sparse indices must be integers, got {idx.dtype}")
    idx = idx.astype(np.int64)
    if idx.size and (idx[0] < 0 or idx[-1] >= n or not (np.diff(idx) > 0).all()):
        raise ValueError(f"sparse indices must be strictly increasing in [0, {n})")
    return int(n), idx


def _bin_size(n: int) -> int:
    return n + (2 if n < 2**8 else 3 if n < 2**16 else 5)


def _form_size(key: str, dt: str, length: int, nbytes: int) -> int:
    """Exact packed bytes of `key: array` (only what differs between the index and mask forms)."""
    head = msgpack.packb({"dt": dt, "sh": [length], "b": b""}, use_bin_type=True)
    return len(msgpack.packb(key)) + len(head) - _bin_size(0) + _bin_size(nbytes)


def encode_sparse(sv: SparseVector, dt: str = "f4") -> dict:
    """Encode as indices or as a packed mask, whichever is fewer bytes (indices on a tie)."""
    n, idx = check_sparse(sv)
    values = encode_array(np.asarray(sv.values).reshape(-1), dt)
    idt = "u2" if n < 2**16 else "u4"
    nnz = idx.size
    by_index = _form_size("i", idt, nnz, nnz * _DTYPES[idt].itemsize)
    by_mask = _form_size("mask", "u1", (n + 7) // 8, (n + 7) // 8)
    if by_index <= by_mask:
        return {"n": n, "i": encode_array(idx, idt), "v": values}
    bits = np.zeros(n, dtype=bool)
    bits[idx] = True
    return {"n": n, "mask": encode_array(np.packbits(bits, bitorder="little"), "u1"), "v": values}


def mask_indices(packed: np.ndarray, n: int) -> np.ndarray:
    """The set positions (int64, ascending) of a little-endian packed mask of `n` bits: the same as
    np.flatnonzero(np.unpackbits(packed, count=n, bitorder="little")), faster where APUD's masks live.

    numpy's nonzero() over bools has two loops: a memchr scan for inputs at most 10 % set and a branch-free
    one above. On large random masks 6-10 % set (APUD's default K = d/10 is exactly 10 %) the scan
    mispredicts at nearly every run: measured at d = 100,000 and 10 %, 150 us against 73 us for the
    branch-free loop (which costs the same at any density); below 6 %, or below 2**15 bits (where it stays
    in cache), the scan is the faster one. So such a mask is unpacked with enough set padding bits after
    it to pass 10 %, and the padding's positions, all at or past n, are cut off the end.
    """
    bits = np.unpackbits(packed, count=n, bitorder="little").view(bool)  # nonzero() is ~5x faster on bools
    ones = int(np.count_nonzero(bits))
    if n < 2**15 or not 0.06 * n <= ones <= 0.1 * n:
        return np.flatnonzero(bits)
    pad = (n - 10 * ones) // 9 + 1  # the least p with ones + p > (n + p) / 10
    padded = np.empty(n + pad, dtype=bool)
    padded[:n] = bits
    padded[n:] = True
    return np.flatnonzero(padded)[:ones]


def decode_sparse(obj: Any, *, what: str, limits: Limits = DEFAULT_LIMITS) -> SparseVector:
    """Validate and decode a wire sparse vector; indices come back int64, values float32."""
    form = "mask" if isinstance(obj, dict) and "mask" in obj else "i"
    expect_keys(obj, ("n", form, "v"), what)
    n = expect_int(obj["n"], f"{what} length n", 0, MAX_SPARSE_N - 1)
    if n > limits.max_elements:
        raise WireError(f"{what}: length {n} exceeds the element limit {limits.max_elements}")
    v = decode_array(obj["v"], what=f"{what} values", limits=limits, dts=FLOAT_DTS, ndim=1)
    if form == "i":
        idx = decode_array(obj["i"], what=f"{what} indices", limits=limits, dts=("u2", "u4"), ndim=1)
        return sparse_from_parts(n, idx, None, v, what)
    packed = decode_array(obj["mask"], what=f"{what} mask", limits=limits, dts=("u1",), ndim=1)
    return sparse_from_parts(n, None, packed, v, what)


def sparse_from_parts(
    n: int, indices: np.ndarray | None, packed: np.ndarray | None, values: np.ndarray, what: str
) -> SparseVector:
    """`decode_sparse` once its arrays are decoded (`n` checked): the indices (u2/u4), or else the packed
    mask (u1), checked against `n` and the values."""
    v = values
    if indices is not None:
        idx = indices.astype(np.int64)
        if idx.size != v.size:
            raise WireError(f"{what}: {idx.size} indices but {v.size} values")
        step = np.diff(idx)
        if (step == 0).any():
            raise WireError(f"{what}: duplicate index {int(idx[np.flatnonzero(step == 0)[0]])}")
        if (step < 0).any():
            raise WireError(f"{what}: indices not sorted ascending at position {int(np.flatnonzero(step < 0)[0]) + 1}")
        if idx.size and idx[-1] >= n:
            raise WireError(f"{what}: index {int(idx[-1])} out of range for length {n}")
        return SparseVector(n, idx, v)
    assert packed is not None
    if packed.size != (n + 7) // 8:
        raise WireError(f"{what}: mask has {packed.size} bytes; length {n} needs {(n + 7) // 8}")
    if n % 8 and packed[-1] >> (n % 8):
        raise WireError(f"{what}: mask sets bits beyond length {n}")
    idx = mask_indices(packed, n)
    if idx.size != v.size:
        raise WireError(f"{what}: mask popcount {idx.size} does not match {v.size} values")
    return SparseVector(n, idx, v)


# --- envelope ------------------------------------------------------------------------------------


_H = TypeVar("_H", bound="Head")


@dataclass(frozen=True)
class Head:
    """The envelope's fields other than the body: what a receiver judges a message by before its body."""

    v: int
    kind: str
    fed: str
    round: int
    phase: str
    sender: str
    msg_id: str


@dataclass(frozen=True)
class Envelope(Head):
    body: dict


@dataclass(frozen=True)
class Header(Head):
    """A message read up to its body: every envelope field is checked, the message is within the size
    limit of its kind, and the body is still bytes, skipped without building one object. A receiver
    checks kind, sender, federation and round on the header and pays for the body (`open`) only for a
    message it would take."""

    size: int  # bytes of the whole message
    body_bytes: memoryview = field(repr=False, compare=False)
    limits: Limits = field(repr=False, compare=False)

    def open(self) -> Envelope:
        """Parse the body (a map), within the decoder limits and the object budget of this kind."""
        budget = self.limits.max_body_objects(self.kind)
        body = _unpack(self.body_bytes, self.limits, budget, f"{self.kind} body")
        head = {k: getattr(self, k) for k in ENVELOPE_KEYS if k != "body"}
        return _built(Envelope, head, body=body)


def _built(cls: type[_H], fields: dict[str, Any], **more: Any) -> _H:
    """A frozen envelope dataclass from fields this module checked: its instance dict filled directly (the
    generated __init__ sets each frozen field through object.__setattr__, ~4 us a message, twice per upload)."""
    obj = cls.__new__(cls)
    obj.__dict__.update(fields, **more)
    return obj


def _check_head(top: Any) -> dict[str, Any]:
    """The checked envelope fields of the top-level map `top`, all but the body (whose key must be there)."""
    if not isinstance(top, dict):
        raise WireError(f"message: top level must be a map, got {_tname(top)}")
    if "v" not in top:
        raise WireError("message: missing key 'v' (wire version)")
    v = top["v"]
    if isinstance(v, bool) or not isinstance(v, int) or v != WIRE_VERSION:
        side = "the other side" if isinstance(v, int) and not isinstance(v, bool) and v < WIRE_VERSION else "this side"
        raise WireError(
            f"unsupported wire version {v!r}; this build speaks {WIRE_VERSION} — upgrade protofl-edge on {side}"
        )
    expect_keys(top, ENVELOPE_KEYS, "message")
    kind = top["kind"]
    if not isinstance(kind, str) or kind not in KINDS:
        raise WireError(f"message: unknown kind {kind!r}; known: {', '.join(sorted(KINDS))}")
    phase = top["phase"]
    if not isinstance(phase, str) or phase not in PHASES:
        raise WireError(f"message: unknown phase {phase!r}; known: {sorted(PHASES)}")
    return {
        "v": v,
        "kind": kind,
        "fed": expect_name(top["fed"], "message fed"),
        "round": expect_int(top["round"], "message round", 0, MAX_ROUND - 1),
        "phase": phase,
        "sender": expect_name(top["sender"], "message sender"),
        "msg_id": expect_str(top["msg_id"], "message msg_id", 64),
    }


def pack_envelope(env: Envelope) -> bytes:
    """Serialise; raises ValueError if the envelope would not pass `unpack_envelope`."""
    top = {k: getattr(env, k) for k in ENVELOPE_KEYS}
    try:
        _check_head(top)
        if not isinstance(env.body, dict):
            raise WireError(f"message: body must be a map, got {_tname(env.body)}")
    except WireError as e:
        raise ValueError(f"cannot send this envelope: {e}") from None
    return msgpack.packb(top, use_bin_type=True)


def _type_names() -> tuple[str, ...]:
    """The Python type name (as `_tname` gives it) of the msgpack value that starts with each byte."""
    names = ["ext"] * 256  # c7-c9 and d4-d8: the ext types, which the decoder refuses
    spans = [
        (0x00, 0x7F, "int"), (0x80, 0x8F, "dict"), (0x90, 0x9F, "list"), (0xA0, 0xBF, "str"), (0xC0, 0xC0, "nil"),
        (0xC1, 0xC1, "invalid"), (0xC2, 0xC3, "bool"), (0xC4, 0xC6, "bytes"), (0xCA, 0xCB, "float"),
        (0xCC, 0xD3, "int"), (0xD9, 0xDB, "str"), (0xDC, 0xDD, "list"), (0xDE, 0xDF, "dict"), (0xE0, 0xFF, "int"),
    ]  # fmt: skip
    for lo, hi, name in spans:
        names[lo : hi + 1] = [name] * (hi - lo + 1)
    return tuple(names)


_TYPE_AT = _type_names()
_ENVELOPE_OBJECTS = 64


def object_counter(limit: int, what: str) -> Callable[[Any], Any]:
    """A msgpack list/object hook that refuses (WireError) the container that takes the count over `limit`
    (also protofl/checkpoint.py's, for a checkpoint file)."""
    left = [limit]

    def count(container: Any) -> Any:
        left[0] -= len(container) + 1
        if left[0] < 0:
            raise WireError(f"{what}: more than {limit} msgpack objects")
        return container

    return count


def _options(limits: Limits, max_objects: int, what: str) -> dict[str, Any]:
    count = object_counter(max_objects, what)
    return {
        "raw": False,
        "strict_map_key": True,
        "use_list": True,
        "list_hook": count,
        "object_hook": count,
        "max_str_len": limits.max_str_len,
        "max_bin_len": limits.max_bin_len,
        "max_array_len": limits.max_list_len,
        "max_map_len": limits.max_map_len,
        "max_ext_len": 0,
    }


def _wire_error(e: Exception) -> WireError:
    """What msgpack raised, as one WireError a person can read."""
    if isinstance(e, WireError):
        return e
    if isinstance(e, msgpack.OutOfData):
        return WireError("message: truncated msgpack (incomplete input)")
    if isinstance(e, msgpack.ExtraData):
        return WireError(f"message: trailing bytes after the msgpack object ({len(e.extra)} extra)")
    if isinstance(e, msgpack.StackError):
        return WireError("message: msgpack nested too deeply")
    if isinstance(e, msgpack.FormatError):
        return WireError("message: not msgpack (invalid format byte)")
    if isinstance(e, UnicodeDecodeError):
        return WireError("message: string is not valid UTF-8")
    # the C unpacker signals most problems as bare ValueError/TypeError
    text = str(e)
    if "incomplete" in text:
        reason = "truncated msgpack (incomplete input)"
    elif "max_ext_len" in text:
        reason = "ext types are not allowed"
    elif "map key" in text:
        reason = "map keys must be strings"
    elif "exceeds max_" in text:
        reason = f"a string, bin, array or map is over the decoder limit ({text[:100]})"
    else:
        reason = f"invalid msgpack ({type(e).__name__}: {text[:200]})"
    return WireError(f"message: {reason}")


def _unpack(data: bytes | memoryview, limits: Limits, max_objects: int, what: str) -> Any:
    try:  # (not a contextmanager: that costs more than the unpacking of a small upload)
        return msgpack.unpackb(data, **_options(limits, max_objects, what))
    except Exception as e:
        raise _wire_error(e) from None


def _read_top(buf: bytes, limits: Limits) -> tuple[dict[Any, Any], tuple[int, int] | None]:
    """The top-level map with every value but the body's parsed, and the byte range of the body,
    which is skipped (at C speed, building no objects). Key sets are `_check_head`'s to judge."""
    if not buf:
        raise WireError("message: truncated msgpack (incomplete input)")
    if _TYPE_AT[buf[0]] == "invalid":
        raise WireError("message: not msgpack (invalid format byte)")
    if _TYPE_AT[buf[0]] != "dict":
        raise WireError(f"message: top level must be a map, got {_TYPE_AT[buf[0]]}")
    # The envelope's values are scalars: a container there is refused after a few objects, not a million.
    reader = msgpack.Unpacker(max_buffer_size=len(buf), **_options(limits, _ENVELOPE_OBJECTS, "message envelope"))
    top: dict[Any, Any] = {}
    body_at = None
    try:
        reader.feed(buf)
        entries = reader.read_map_header()
        if entries > limits.max_map_len:  # as unpackb would refuse it: the loop below stays short
            raise WireError(f"message: a map is over the decoder limit ({entries} entries, max {limits.max_map_len})")
        for _ in range(entries):
            key = reader.unpack()
            if not isinstance(key, (str, bytes)):  # what strict_map_key refuses inside a map
                raise WireError("message: map keys must be strings")
            if key == "body":
                start = reader.tell()
                reader.skip()
                body_at, top[key] = (start, reader.tell()), None
            elif key in ENVELOPE_KEYS:
                top[key] = reader.unpack()
            else:  # an unknown key is refused by its name; its value is not worth parsing
                reader.skip()
                top[key] = None
    except Exception as e:
        raise _wire_error(e) from None
    if reader.tell() != len(buf):
        raise WireError(f"message: trailing bytes after the msgpack object ({len(buf) - reader.tell()} extra)")
    return top, body_at


def read_header(data: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> Header:
    """Parse and check the envelope, leaving the body unparsed; refuse a message over its kind's size."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"message: expected bytes, got {_tname(data)}")
    size = memoryview(data).nbytes
    if size > limits.max_message_bytes:
        raise WireError(f"message: {size} bytes, over the limit of {limits.max_message_bytes}")
    buf = data if isinstance(data, bytes) else bytes(data)  # the header keeps a view: a bytearray may change
    top, body_at = _read_top(buf, limits)
    head = _check_head(top)
    if size > limits.max_bytes(head["kind"]):
        raise WireError(
            f"message: {size} bytes, over the limit of {limits.max_bytes(head['kind'])} for a {head['kind']} message"
        )
    assert body_at is not None  # _check_head found the key
    start, end = body_at
    if _TYPE_AT[buf[start]] != "dict":
        raise WireError(f"message: body must be a map, got {_TYPE_AT[buf[start]]}")
    return _built(Header, head, size=size, body_bytes=memoryview(buf)[start:end], limits=limits)


def unpack_envelope(data: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> Envelope:
    """Parse and validate the envelope; the body is returned as a plain map for `messages` to check."""
    return read_header(data, limits).open()
