"""What aggregator shards and their coordinator say to each other (docs/design.md, "Scale-out"); numpy only.

Every message is a msgpack map `{"v": VERSION, "k": kind, ...}` whose arrays travel as typed byte strings
(protofl.checkpoint.packb; no pickle). `decode` refuses anything else - another version, another kind,
a field of the wrong type - with a ShardWireError that says what was wrong; shapes and finiteness of a
partial are checked where it is merged (broker_server/core/stages.py PhaseRun.check_partial).

    phase     coordinator -> shards, retained: the machine at the open phase's boundary (its config, the
              model, the clipping radii, the round and phase), the clipping policy, the decoder limits and
              the member list: all a shard needs to fold as the coordinator would (no config of its own)
    close     coordinator -> shards, retained: the phase is closing; which uploads each shard's partial holds
    progress  shard -> coordinator: it folded these uploads of round/phase: [[sender, kind, nbytes], ...]
              (one message per batch the shard took in)
    partial   shard -> coordinator, retained: its partial phase over exactly the uploads `close` gave it
    partials  (the coordinator's journal only) every shard's partial, as merged
    hello     shard -> coordinator, retained: it is subscribed (sent after its subscriptions, so the broker
              has them): a coordinator announces the federation only once every shard said it
    lost      (the coordinator's journal only) it gave up on a shard's partial for the closing phase
              (`start --shard-timeout`): the phase closes without that shard's uploads
    gone      shard's will, published by the broker, retained: the shard's session ended without it coming
              back (its --shard-timeout after it vanished), and with it whatever the broker held for it; a shard
              that starts clears it
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from protofl.algorithms.robust import ClipPolicy
from protofl.checkpoint import packb, unpack_tree
from protofl.errors import WireError
from protofl.wire import Limits

VERSION = 1
KINDS = ("phase", "close", "progress", "partial", "partials", "hello", "lost", "gone")
_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "phase": {
        "round": int,
        "phase": str,
        "finished": bool,
        "machine": (dict, type(None)),
        "policy": dict,
        "limits": dict,
        "members": (list, type(None)),
    },
    "close": {"round": int, "phase": str, "assignment": dict},
    "progress": {"shard": str, "round": int, "phase": str, "entries": list},  # [[sender, kind, nbytes], ...]
    "partial": {"shard": str, "round": int, "phase": str, "uploads": int, "part": dict},
    "partials": {"round": int, "phase": str, "parts": dict},  # the coordinator's journal: every shard's, merged
    "hello": {"shard": str},
    "lost": {"shard": str, "round": int, "phase": str},  # the coordinator's journal: a shard given up on
    "gone": {"shard": str},  # a shard's will: its session ended at the broker
}


class ShardWireError(WireError):
    """A shard message that is not what this version of the protocol sends."""


def encode(what: str, /, **fields: Any) -> bytes:
    assert what in KINDS and set(fields) == set(_FIELDS[what]), (what, sorted(fields))
    return packb({"v": VERSION, "k": what, **fields})


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
        raise ShardWireError(
            f"expected a version {VERSION} '{kind}' message, got {what}: are the shards and the "
            f"coordinator the same protofl version?"
        )
    for name, tp in _FIELDS[kind].items():
        value = msg.get(name)
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            raise ShardWireError(f"{kind} message: field '{name}' is {type(value).__name__}")
    return msg


def policy_of(fields: dict[str, Any]) -> ClipPolicy:
    try:
        return ClipPolicy(**fields)
    except (TypeError, ValueError) as exc:
        raise ShardWireError(f"phase message: clipping policy {fields}: {exc}") from None


def limits_of(fields: dict[str, Any]) -> Limits:
    names = {f.name for f in dataclasses.fields(Limits)}
    if set(fields) != names or not all(isinstance(v, int) and v > 0 for v in fields.values()):
        raise ShardWireError(f"phase message: decoder limits {fields}, expected positive {sorted(names)}")
    return Limits(**fields)


def progress_entries(msg: dict[str, Any]) -> list[tuple[str, str, int]]:
    """A progress message's uploads, checked: (sender, kind, nbytes) each."""
    out = []
    for entry in msg["entries"]:
        if not (
            isinstance(entry, list)
            and len(entry) == 3
            and isinstance(entry[0], str)
            and isinstance(entry[1], str)
            and isinstance(entry[2], int)
            and not isinstance(entry[2], bool)
            and entry[2] >= 0
        ):
            raise ShardWireError(f"progress message: entry {entry!r} is not [sender, kind, bytes]")
        out.append((entry[0], entry[1], entry[2]))
    return out
