"""Atomic, validated checkpoints of the aggregator's state (written at phase boundaries).

File layout: b"PFCK1\\n" | SHA-256 of the body (32 bytes) | body (msgpack). The body is a tree of
maps, lists, strings, numbers and numpy arrays; an array travels as `{"__nd__": dtype, "sh": shape,
"b": raw bytes}` (no pickle, no msgpack-numpy). `write_checkpoint` writes a temporary file, fsyncs it,
renames it over the old one and fsyncs the directory, so a crash leaves either the old checkpoint or
the new one, never half of one. `read_checkpoint` refuses a file whose magic or hash is wrong with a
`CheckpointError` that names the file and what to do; a damaged checkpoint is never used.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from protofl.errors import ProtoFLError
from protofl.wire.codec import object_counter

MAGIC = b"PFCK1\n"
_ND = "__nd__"
_DTYPES = {"<f4", "<f8", "<f2", "<i8", "<i4", "<i2", "|i1", "|u1", "<u2", "<u4", "<u8", "|b1"}


class CheckpointError(ProtoFLError, RuntimeError):
    """A checkpoint that cannot be trusted (damaged, or of another federation)."""


def _pack(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        a = np.ascontiguousarray(obj)
        return {_ND: a.dtype.str, "sh": list(a.shape), "b": a.tobytes()}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {k: _pack(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_pack(v) for v in obj]
    return obj


def _unpack(obj: Any) -> Any:
    if isinstance(obj, dict):
        if _ND in obj:
            dt, shape, raw = obj[_ND], tuple(obj["sh"]), obj["b"]
            if dt not in _DTYPES:
                raise ValueError(f"array of dtype {dt!r}")
            arr = np.frombuffer(raw, dtype=np.dtype(dt))
            if arr.size != int(np.prod(shape, dtype=np.int64)):
                raise ValueError(f"array of shape {shape} with {arr.size} values")
            return arr.reshape(shape).copy()  # writable, and not a view of the file's bytes
        return {k: _unpack(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_unpack(v) for v in obj]
    return obj


def pack_tree(obj: Any) -> Any:
    """A tree of maps, lists and numpy arrays as msgpack-ready values (arrays as typed byte strings)."""
    return _pack(obj)


def unpack_tree(obj: Any) -> Any:
    """`pack_tree`'s inverse (ValueError for an array of another dtype or the wrong size)."""
    return _unpack(obj)


def _packed_leaf(obj: Any) -> Any:
    """msgpack's `default`: `_pack` for the leaves msgpack cannot write, called from its C walk of the tree (a
    checkpoint of 3,000 members is ~20,000 nodes: a Python walk of them cost ~30 ms per phase, issue 27)."""
    if isinstance(obj, (np.ndarray, np.generic)):
        return _pack(obj)
    raise TypeError(f"{type(obj).__name__} cannot be written to a checkpoint")


def packb(tree: Any) -> bytes:
    """msgpack of `pack_tree(tree)`, the same bytes, without its Python walk: msgpack writes tuples as lists and
    float64 scalars (a float subclass) as the floats `.item()` gives, and calls back only for the other numpy
    leaves (the shards' messages, issue 48: a walk per placed upload was 15.7 % of the coordinator's thread)."""
    return msgpack.packb(tree, use_bin_type=True, default=_packed_leaf)


def encode_checkpoint(state: dict[str, Any]) -> bytes:
    body = packb(state)
    return MAGIC + hashlib.sha256(body).digest() + body


def write_checkpoint(path: Path | str, state: dict[str, Any]) -> None:
    """Replace the checkpoint at `path` by `state`, atomically and durably."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    data = encode_checkpoint(state)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)  # the rename itself must be on disk before we acknowledge anything after it
    finally:
        os.close(dfd)


# Decoder bounds (issue 43): a body that passes its hash is still a file a user may be handed, and a megabyte
# of empty msgpack lists is a million Python objects. Lengths are checked on each header before its container is
# built; the object count is checked as containers are built (as protofl/wire/codec.py does for the wire). A
# checkpoint of 3,000 members is ~20,000 objects, so these leave room for federations 100 times that size.
MAX_OBJECTS = 2_000_000
MAX_ARRAY_LEN = 1_000_000
MAX_MAP_LEN = 1_000_000
MAX_STR_LEN = 16 << 20
MAX_BIN_LEN = 1 << 30


def _bounded() -> dict[str, Any]:
    count = object_counter(MAX_OBJECTS, "the body")
    return {
        "raw": False,
        "strict_map_key": False,
        "list_hook": count,
        "object_hook": count,
        "max_array_len": MAX_ARRAY_LEN,
        "max_map_len": MAX_MAP_LEN,
        "max_str_len": MAX_STR_LEN,
        "max_bin_len": MAX_BIN_LEN,
        "max_ext_len": 0,
    }


def read_checkpoint(path: Path | str) -> dict[str, Any] | None:
    """The state in `path`, None if there is no checkpoint; CheckpointError if it is damaged."""
    path = Path(path)
    if not path.exists():
        return None
    data = path.read_bytes()
    what_to_do = (
        f"it is not used. Restore {path.parent} from a backup, or move it aside to start a new "
        f"federation (devices will have to join again)"
    )
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 32:
        raise CheckpointError(f"checkpoint {path} is not a protofl checkpoint (bad header); {what_to_do}")
    digest, body = data[len(MAGIC) : len(MAGIC) + 32], data[len(MAGIC) + 32 :]
    if hashlib.sha256(body).digest() != digest:
        raise CheckpointError(f"checkpoint {path} is corrupt (SHA-256 mismatch over {len(body)} bytes); {what_to_do}")
    try:
        state = _unpack(msgpack.unpackb(body, **_bounded()))
    except (ValueError, TypeError, KeyError, msgpack.ExtraData) as exc:
        raise CheckpointError(f"checkpoint {path} passes its hash but does not decode ({exc}); {what_to_do}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} does not hold a state map; {what_to_do}")
    return state
