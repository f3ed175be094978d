"""A dataclass's checkpoint form, derived from its field types: the state that survives a crash is declared
once, as the fields of a dataclass, and nothing else has to list it again.

`to_plain(obj)` turns a dataclass (and what its fields hold: numbers, strings, numpy arrays, enums, sets,
lists, tuples, dicts, other dataclasses, None) into plain values and arrays that protofl/checkpoint.py
writes; `from_plain(T, data)` builds a `T` back, guided by the type hints, so a field added to a state
dataclass is saved and restored without another line anywhere. A field that is not state (a callback, the
config it was built from, a cache) says so with `field(metadata=NOT_STATE)`; a field with a default that
`from_plain`'s data lacks (state added since it was written) gets its default; `restore_fields` sets the
state fields of an existing object (one whose non-state fields were built from the config).
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

import numpy as np

NOT_STATE = {"state": False}
T = TypeVar("T")


def state_fields(cls: type) -> list[dataclasses.Field[Any]]:
    """The fields of a dataclass that are state (every field not marked NOT_STATE)."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("state", True)]


_FLAT: dict[type, tuple[str, ...] | None] = {}


def _flat_fields(cls: type) -> tuple[str, ...] | None:
    """The state fields of a dataclass whose every state field holds a str, int, float or bool, else None:
    such an object is its fields as they are (a member's Join: 3,000 of them in a fleet's checkpoint)."""
    if cls not in _FLAT:
        hints = typing.get_type_hints(cls)
        fields = state_fields(cls)
        _FLAT[cls] = (
            tuple(f.name for f in fields) if all(hints[f.name] in (str, int, float, bool) for f in fields) else None
        )
    return _FLAT[cls]


def to_plain(obj: Any) -> Any:
    """`obj` as plain values (dict keys become [key, value] pairs where they are not strings)."""
    flat = _FLAT.get(type(obj))  # first: a fleet's members are most of the nodes
    if flat is not None:
        return {name: getattr(obj, name) for name in flat}
    if obj is None or isinstance(obj, (bool, int, float, str, bytes, np.ndarray)):
        return obj
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, enum.Enum):
        return obj.value
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        if _flat_fields(type(obj)) is not None:  # declared str/int/float/bool (a numpy scalar there is the packer's)
            return to_plain(obj)
        return {f.name: to_plain(getattr(obj, f.name)) for f in state_fields(type(obj))}
    if isinstance(obj, (set, frozenset)):
        return sorted(to_plain(x) for x in obj)
    if isinstance(obj, (list, tuple)):
        if all(type(x) is str for x in obj):  # a round's clients: a fleet's names, already plain
            return list(obj)
        return [to_plain(x) for x in obj]
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: to_plain(v) for k, v in obj.items()}
        return [[to_plain(k), to_plain(v)] for k, v in obj.items()]
    raise TypeError(f"{type(obj).__name__} is not checkpoint state (declare a dataclass, or mark it NOT_STATE)")


def from_plain(tp: Any, data: Any) -> Any:
    """A value of type `tp` from its `to_plain` form."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return data
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if data is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return from_plain(inner[0], data) if len(inner) == 1 else data
    if origin in (list, tuple, set, frozenset):
        args = typing.get_args(tp)
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return tuple(from_plain(a, x) for a, x in zip(args, data, strict=True))
        items = [from_plain(args[0] if args else Any, x) for x in data]
        return origin(items)
    if origin is dict:
        kt, vt = typing.get_args(tp) or (Any, Any)
        pairs = data.items() if isinstance(data, dict) else data
        return {from_plain(kt, k): from_plain(vt, v) for k, v in pairs}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        # A field the data lacks keeps its default where it has one (state added since the data was written)
        return tp(
            **{
                f.name: from_plain(hints[f.name], data[f.name])
                for f in state_fields(tp)
                if f.name in data or not _has_default(f)
            }
        )
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp(data)
    if tp is np.ndarray:
        return np.asarray(data)
    if tp in (int, float, str, bool):
        return tp(data)
    return data


def _has_default(f: dataclasses.Field[Any]) -> bool:
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


def restore_fields(
    obj: Any, data: Mapping[str, Any], *, older: Mapping[str, Any] | None = None, what: str = ""
) -> None:
    """Set `obj`'s state fields from their `to_plain` form (its other fields stay as they are). `older`: where a
    field that `data` lacks was kept in an earlier layout of the checkpoint; a field in neither is a ValueError
    naming it (`what`: whose state)."""
    hints = typing.get_type_hints(type(obj))
    for f in state_fields(type(obj)):
        if f.name in data:
            value = data[f.name]
        elif older is not None and f.name in older:
            value = older[f.name]
        else:
            raise ValueError(f"{what or type(obj).__name__} has no saved '{f.name}' (a checkpoint of another version)")
        setattr(obj, f.name, from_plain(hints[f.name], value))
