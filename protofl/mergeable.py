"""Mergeable partial folds: what one aggregator shard hands the coordinator at a phase's close (numpy only).

Sharded aggregators (docs/design.md, "Scale-out") split one phase's uploads between several processes;
each folds its share into the same accumulators, and at the phase's close the coordinator adds the
shards' accumulators into its own and finishes the phase once. That is exact for sums (a mean's numerator
and denominator, a consensus sum, sender counts) up to the order of float additions, and for the
coordinate-wise robust means too, whose "sum" is the list of rows (concatenated, then sorted as before).

An accumulator says it is mergeable by deriving from `Additive` and naming, in `additive`, the attributes
whose values add up across shards: arrays (added, same shape), numbers (added), lists (concatenated) and
nested `Additive`s (merged). Everything else about it (its reference vector, its widths) is built from the
state every shard shares, so it is the same everywhere and does not travel. A fold whose accumulator is not
`Additive` (e.g. a third-party `mean_aggregator` that keeps a median of its own) raises `NotMergeable`
with the reason, and a sharded federation refuses to start with it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from protofl.errors import ProtoFLError

__all__ = ["Additive", "NotMergeable", "merge_into", "partial_of"]


class NotMergeable(ProtoFLError, ValueError):
    """A fold whose accumulator cannot be split between aggregator shards and merged."""


class Additive:
    """An accumulator whose state is sums over its uploads: `additive` names those attributes."""

    additive: ClassVar[tuple[str, ...]] = ()

    def partial(self) -> dict[str, Any]:
        """The sums as plain values and arrays (copies)."""
        return {name: partial_of(getattr(self, name), f"{type(self).__name__}.{name}") for name in self.additive}

    def merge(self, part: Mapping[str, Any]) -> None:
        """Add another shard's `partial()`; checks all of it first (a bad one changes nothing)."""
        where = type(self).__name__
        if not isinstance(part, Mapping) or set(part) != set(self.additive):
            got = sorted(part) if isinstance(part, Mapping) else type(part).__name__
            raise ValueError(f"{where}: partial has {got}, expected {sorted(self.additive)}")
        for name in self.additive:
            _add(getattr(self, name), part[name], f"{where}.{name}", check=True)
        for name in self.additive:
            setattr(self, name, _add(getattr(self, name), part[name], f"{where}.{name}", check=False))


def partial_of(value: Any, where: str) -> Any:
    """A mergeable value's partial form: arrays and lists copied, `Additive`s by their `partial()`,
    dicts of them per key; anything else is refused with `where` in the reason."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, list):
        return [partial_of(v, where) for v in value]
    if isinstance(value, dict):
        return {k: partial_of(v, f"{where}[{k}]") for k, v in value.items()}
    if isinstance(value, Additive):
        return value.partial()
    raise NotMergeable(
        f"{where} is a {type(value).__module__}.{type(value).__name__}, which does not say how two "
        f"shards' copies merge (derive it from protofl.mergeable.Additive and name its sums in "
        f"`additive`): this federation cannot run on sharded aggregators; run one aggregator"
    )


def merge_into(target: Any, part: Any, where: str, *, check: bool = False) -> Any:
    """`target` with another shard's `part` added (in place where it can be; the result is returned).
    `check`: only validate, change nothing."""
    return _add(target, part, where, check=check)


def _add(mine: Any, theirs: Any, where: str, *, check: bool) -> Any:
    if isinstance(mine, Additive):
        if check:
            if not isinstance(theirs, Mapping) or set(theirs) != set(mine.additive):
                raise ValueError(f"{where}: partial has {_keys(theirs)}, expected {sorted(mine.additive)}")
            for name in mine.additive:
                _add(getattr(mine, name), theirs[name], f"{where}.{name}", check=True)
        else:
            mine.merge(theirs)
        return mine
    if isinstance(mine, np.ndarray):
        arr = theirs if isinstance(theirs, np.ndarray) else None
        if arr is None or arr.shape != mine.shape or arr.dtype.kind not in "fiub":
            got = f"shape {arr.shape} {arr.dtype}" if arr is not None else type(theirs).__name__
            raise ValueError(f"{where}: expected an array of shape {mine.shape}, got {got}")
        if not np.isfinite(arr).all():
            raise ValueError(f"{where}: partial contains NaN or inf")
        if not check:
            mine += arr.astype(mine.dtype, copy=False)
        return mine
    if isinstance(mine, bool) or mine is None:
        if theirs != mine:
            raise ValueError(f"{where}: expected {mine!r}, got {theirs!r}")
        return mine
    if isinstance(mine, (int, float)):
        if (
            isinstance(theirs, bool)
            or not isinstance(theirs, (int, float))
            or not math.isfinite(theirs)
            or (isinstance(mine, int) and not isinstance(theirs, int))
        ):
            raise ValueError(f"{where}: expected a finite {type(mine).__name__}, got {theirs!r}")
        return mine if check else mine + theirs
    if isinstance(mine, list):
        if not isinstance(theirs, list):
            raise ValueError(f"{where}: expected a list, got {type(theirs).__name__}")
        rows = [_row(v, mine[0] if mine else None, f"{where}[{i}]") for i, v in enumerate(theirs)]
        if not check:
            mine.extend(rows)
        return mine
    raise NotMergeable(f"{where} is a {type(mine).__name__}, which does not merge")


def _row(value: Any, like: Any, where: str) -> Any:
    """One list item of a partial (a robust mean's row): an array like the rows already there."""
    if not isinstance(value, np.ndarray) or value.ndim != 1 or value.dtype.kind != "f":
        raise ValueError(f"{where}: expected a 1-D float array")
    if like is not None and value.shape != like.shape:
        raise ValueError(f"{where}: expected shape {like.shape}, got {value.shape}")
    if np.isinf(value).any():  # NaN marks a coordinate the sender did not send
        raise ValueError(f"{where}: row contains inf")
    return value.astype(np.float64, copy=True)


def _keys(value: Any) -> Any:
    return sorted(value) if isinstance(value, Mapping) else type(value).__name__
