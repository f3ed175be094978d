"""Decoded messages as the kind a test sent.

`decode_message` returns the union of every message kind; a test knows which kind it encoded and says
so here, which both checks it and gives the type checker the message's own fields."""

from __future__ import annotations

from typing import TypeVar

from protofl.wire import Message, decode_message

M = TypeVar("M", bound=Message)


def decode_as(kind: type[M], data: bytes) -> M:
    """The message in `data`, which must be a `kind`."""
    _, msg = decode_message(data)
    assert isinstance(msg, kind), f"expected {kind.__name__}, decoded {type(msg).__name__}"
    return msg
