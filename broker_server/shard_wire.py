"""What aggregator shards and their coordinator say to each other (docs/design.md, "Scale-out"); numpy only.

Every message is a msgpack map `{"v": VERSION, "k": kind, ...}` whose arrays travel as typed byte strings
(protofl.checkpoint.pack_tree; no pickle). `decode` refuses anything else - another version, another kind,
a field of the wrong type - with a ShardWireError that says what was wrong; shapes and finiteness of a
partial are checked where it is merged (broker_server/stages.py PhaseRun.check_partial).

    phase     coordinator -> shards, retained: the machine at the open phase's boundary (the model, its
              clipping radii, the round and phase), or finished
    close     coordinator -> shards, retained: the phase is closing; which uploads each shard's partial holds
    progress  shard -> coordinator: it folded (sender, kind) of round/phase, nbytes long
    partial   shard -> coordinator, retained: its partial phase over exactly the uploads `close` gave it
    partials  (the coordinator's journal only) every shard's partial, as merged
"""

from __future__ import annotations

from typing import Any

import msgpack

from protofl.checkpoint import pack_tree, unpack_tree
from protofl.errors import WireError

VERSION = 1
KINDS = ("phase", "close", "progress", "partial", "partials")
_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "phase": {"round": int, "phase": str, "finished": bool, "machine": (dict, type(None))},
    "close": {"round": int, "phase": str, "assignment": dict},
    "progress": {"shard": str, "round": int, "phase": str, "sender": str, "kind": str, "nbytes": int},
    "partial": {"shard": str, "round": int, "phase": str, "uploads": int, "part": dict},
    "partials": {"round": int, "phase": str, "parts": dict},  # the coordinator's journal: every shard's, merged
}


class ShardWireError(WireError):
    """A shard message that is not what this version of the protocol sends."""


def encode(what: str, /, **fields: Any) -> bytes:
    assert what in KINDS and set(fields) == set(_FIELDS[what]), (what, sorted(fields))
    return msgpack.packb(pack_tree({"v": VERSION, "k": what, **fields}), use_bin_type=True)


def decode(payload: bytes, kind: str, max_bytes: int) -> dict[str, Any]:
    """The fields of a `kind` message; ShardWireError if it is anything else."""
    if len(payload) > max_bytes:
        raise ShardWireError(f"{kind} message of {len(payload)} bytes, over the limit of {max_bytes}")
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False, max_bin_len=max_bytes)
        msg = unpack_tree(raw)
    except (ValueError, TypeError, KeyError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise ShardWireError(f"{kind} message does not decode: {exc}") from None
    if not isinstance(msg, dict) or msg.get("v") != VERSION or msg.get("k") != kind:
        what = (msg.get("v"), msg.get("k")) if isinstance(msg, dict) else type(msg).__name__
        raise ShardWireError(f"expected a version {VERSION} '{kind}' message, got {what}: are the shards and the "
                             f"coordinator the same protofl version?")
    for name, tp in _FIELDS[kind].items():
        value = msg.get(name)
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            raise ShardWireError(f"{kind} message: field '{name}' is {type(value).__name__}")
    return msg
