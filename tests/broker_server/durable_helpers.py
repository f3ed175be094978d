"""Bind an in-process aggregator to a state directory the way `start` does: resume what is there, or start."""

from __future__ import annotations

from pathlib import Path

from broker_server.core.durable import ROTATE_BYTES, DurableState
from broker_server.core.shell import Aggregator


def start_durable(
    agg: Aggregator, state: Path | None, federation: str, rotate_bytes: int = ROTATE_BYTES
) -> DurableState | None:
    """Start `agg`, durable in `state` when given (resumed if the directory holds a run); the store, if any."""
    durable = None
    if state is not None:
        durable = DurableState(state, federation, rotate_bytes=rotate_bytes)
        durable.bind(agg)
        if durable.restore():
            agg.start(resume=True)
            return durable
    agg.start()
    return durable
