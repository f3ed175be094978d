"""Wire codec, version 1: arrays, sparse vectors and the envelope, as msgpack with strict validation.

Everything a peer sends is untrusted. Decoding checks types, shapes, byte counts, ranges and finiteness,
and every failure raises one `WireError` whose message names the field and the reason, so the receiver
can log it and drop the message without changing state. Encoding rejects a sender's own bad input
(NaN, out-of-range integers) with `ValueError`.

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
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from protofl import WIRE_VERSION
from protofl.errors import WireError
from protofl.names import is_valid_name
from protofl.sparse import SparseVector

MiB = 2**20


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


DEFAULT_LIMITS = Limits()

_DTYPES: dict[str, np.dtype] = {
    "f4": np.dtype("<f4"),
    "f2": np.dtype("<f2"),
    "q8": np.dtype("u1"),
    "u1": np.dtype("u1"),
    "u2": np.dtype("<u2"),
    "u4": np.dtype("<u4"),
}
FLOAT_DTS = frozenset({"f4", "f2", "q8"})
UINT_DTS = frozenset({"u1", "u2", "u4"})
MAX_NDIM = 8
MAX_SPARSE_N = 2**32
KINDS = frozenset({"join", "config", "public", "round", "protos", "adapter", "metrics", "status"})
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
    extra = sorted(k for k in obj if k not in keys)
    if extra:
        raise WireError(f"{what}: unknown key {extra[0]!r} (expected {', '.join(keys)})")
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
    sh = _shape(obj["sh"], what, limits, ndim)
    b = obj["b"]
    if not isinstance(b, bytes):
        raise WireError(f"{what}: 'b' must be bin bytes, got {_tname(b)}")
    need = math.prod(sh) * _DTYPES[dt].itemsize
    if len(b) != need:
        raise WireError(f"{what}: shape {sh} needs {need} bytes, got {len(b)}")
    raw = np.frombuffer(b, dtype=_DTYPES[dt]).reshape(sh)
    if dt in UINT_DTS:
        return raw.astype(_DTYPES[dt].newbyteorder("="))
    with np.errstate(over="ignore", invalid="ignore"):
        if dt == "q8":
            scale = expect_float(obj["scale"], f"{what} q8 scale")
            zero = expect_float(obj["zero"], f"{what} q8 zero")
            if scale <= 0:
                raise WireError(f"{what}: q8 scale must be > 0, got {scale}")
            out = ((raw.astype(np.float64) - zero) * scale).astype(np.float32)
        else:
            out = raw.astype(np.float32)
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
        idx = idx.astype(np.int64)
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
    packed = decode_array(obj["mask"], what=f"{what} mask", limits=limits, dts=("u1",), ndim=1)
    if packed.size != (n + 7) // 8:
        raise WireError(f"{what}: mask has {packed.size} bytes; length {n} needs {(n + 7) // 8}")
    if n % 8 and packed[-1] >> (n % 8):
        raise WireError(f"{what}: mask sets bits beyond length {n}")
    # nonzero() over a bool view is ~5x faster than over the uint8 bits unpackbits returns.
    idx = np.flatnonzero(np.unpackbits(packed, count=n, bitorder="little").view(bool)).astype(np.int64)
    if idx.size != v.size:
        raise WireError(f"{what}: mask popcount {idx.size} does not match {v.size} values")
    return SparseVector(n, idx, v)


# --- envelope ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Envelope:
    v: int
    kind: str
    fed: str
    round: int
    phase: str
    sender: str
    msg_id: str
    body: dict


def _check_envelope(top: Any) -> Envelope:
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
    body = top["body"]
    if not isinstance(body, dict):
        raise WireError(f"message: body must be a map, got {_tname(body)}")
    return Envelope(
        v=v,
        kind=kind,
        fed=expect_name(top["fed"], "message fed"),
        round=expect_int(top["round"], "message round", 0, MAX_ROUND - 1),
        phase=phase,
        sender=expect_name(top["sender"], "message sender"),
        msg_id=expect_str(top["msg_id"], "message msg_id", 64),
        body=body,
    )


def pack_envelope(env: Envelope) -> bytes:
    """Serialise; raises ValueError if the envelope would not pass `unpack_envelope`."""
    top = {k: getattr(env, k) for k in ENVELOPE_KEYS}
    try:
        _check_envelope(top)
    except WireError as e:
        raise ValueError(f"cannot send this envelope: {e}") from None
    return msgpack.packb(top, use_bin_type=True)


def _unpack(data: bytes, limits: Limits) -> Any:
    budget = [limits.max_objects]

    def count(container: Any) -> Any:
        budget[0] -= len(container) + 1
        if budget[0] < 0:
            raise WireError(f"message: more than {limits.max_objects} msgpack objects")
        return container

    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            list_hook=count,
            object_hook=count,
            max_str_len=limits.max_str_len,
            max_bin_len=limits.max_bin_len,
            max_array_len=limits.max_list_len,
            max_map_len=limits.max_map_len,
            max_ext_len=0,
        )
    except WireError:
        raise
    except msgpack.ExtraData as e:
        raise WireError(f"message: trailing bytes after the msgpack object ({len(e.extra)} extra)") from None
    except msgpack.StackError:
        raise WireError("message: msgpack nested too deeply") from None
    except msgpack.FormatError:
        raise WireError("message: not msgpack (invalid format byte)") from None
    except UnicodeDecodeError:
        raise WireError("message: string is not valid UTF-8") from None
    except Exception as e:  # the C unpacker signals most problems as bare ValueError/TypeError
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
        raise WireError(f"message: {reason}") from None


def unpack_envelope(data: bytes, limits: Limits = DEFAULT_LIMITS) -> Envelope:
    """Parse and validate the envelope; the body is returned as a plain map for `messages` to check."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"message: expected bytes, got {_tname(data)}")
    size = memoryview(data).nbytes
    if size > limits.max_message_bytes:
        raise WireError(f"message: {size} bytes, over the limit of {limits.max_message_bytes}")
    return _check_envelope(_unpack(data, limits))
