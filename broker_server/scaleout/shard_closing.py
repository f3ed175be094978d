"""The sharded closing (docs/design.md, "Sharded aggregators"): how the coordinator's round machine closes a phase
whose uploads N shards folded. It is a `closing.Closing` strategy injected into the machine: the machine knows
nothing of shards, and this module knows no transport. numpy only.

Its inputs: a shard's `Progress` (it folded a device's upload: placed by the machine exactly as the upload itself
would be, so quorum, deadlines and `--min-clients` behave as with one aggregator, and a copy another shard also
folded is refused as a duplicate), the shards' `Partials` for the closing phase, and `ShardLost` (a shard that sent
no partial within the shard timeout). When the phase closes (quorum or deadline) it does not finish there: it is
marked closing and the strategy answers `Gather`, which the coordinator (coordinator.py) turns into the shards'
close request, over exactly the uploads it counted from each; the merged partials then finish the phase as one
aggregator's folds would. What it keeps lives in the machine's state (the open phase's `owners` and `closing`), so
a checkpoint and a journal replay rebuild it as they rebuild the rest.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from broker_server.core.closing import Closing, ClosingEffect, ClosingInput, Drop
from broker_server.core.rounds import Effect, Received, RoundMachine
from protofl.plan import Phase, Upload

__all__ = ["Gather", "Partials", "Progress", "ShardClosing", "ShardLost"]


@dataclass(frozen=True)
class Progress(ClosingInput):
    """Shard `shard` folded `sender`'s upload of `kind` for round/phase (its envelope's fields), `nbytes` long. The
    coordinator's machine places it as it would the upload itself."""

    shard: str
    sender: str
    kind: str
    round: int
    phase: str
    nbytes: int


@dataclass(frozen=True)
class Partials(ClosingInput):
    """Every shard's partial phase (stages.PhaseRun.partial) for the closing phase."""

    round: int
    phase: str
    parts: dict[str, dict[str, Any]]


@dataclass(frozen=True)
class ShardLost(ClosingInput):
    """A shard sent no partial for the closing phase within the shard timeout; the phase closes without the uploads
    it folded (their devices count as if they had not sent them)."""

    shard: str
    round: int
    phase: str


@dataclass(frozen=True)
class Gather(ClosingEffect):
    """The open phase is closing; each shard must send its partial phase over exactly the uploads `assignment` gives
    it ({shard: [(sender, kind), ...]}), and `Partials` closes it."""

    round: int
    phase: Phase
    assignment: dict[str, list[tuple[str, str]]]


class ShardClosing(Closing):
    """The coordinator's closing: a phase closes by merging its shards' partials."""

    def close(self, machine: RoundMachine, why: str) -> list[Effect]:
        assert machine.phase is not None
        machine.phase.closing = why
        return [self.gather(machine)]

    def announce(self, machine: RoundMachine) -> list[Effect]:
        """After a restart: a phase that was closing asks for the partials again."""
        open_ = machine.phase
        return [self.gather(machine)] if open_ is not None and open_.closing else []

    def accepts(self, machine: RoundMachine, inp: ClosingInput | Received) -> bool:
        s, open_ = machine.state, machine.phase
        if isinstance(inp, ShardLost):
            if open_ is None or not open_.closing or (inp.round, inp.phase) != (s.round, open_.phase.value):
                raise Drop(
                    "stale", f"shard {inp.shard} lost in round {inp.round}/{inp.phase}; nothing of it is closing"
                )
            return True
        if isinstance(inp, Partials):
            if open_ is None or not open_.closing or (inp.round, inp.phase) != (s.round, open_.phase.value):
                raise Drop("stale", f"partials for round {inp.round}/{inp.phase}; nothing of it is closing")
            assert machine.run is not None
            for shard, part in sorted(inp.parts.items()):
                try:
                    machine.run.check_partial(part)
                except ValueError as exc:
                    raise Drop("invalid", f"partial of shard {shard}: {exc}") from None
            return True
        if not isinstance(inp, Progress):
            raise Drop("unexpected_kind", f"{type(inp).__name__}: not an input of the sharded closing")
        owner = open_.owners.get(f"{inp.sender}/{inp.kind}") if open_ is not None else None
        if owner == inp.shard and (inp.round, inp.phase) == (s.round, open_.phase.value if open_ else ""):
            return False  # the same shard saying it again (it restarted): nothing new
        if open_ is not None and open_.closing and (inp.round, inp.phase) == (s.round, open_.phase.value):
            raise Drop(
                "closing",
                f"{inp.kind} of {inp.sender} from shard {inp.shard}: round {inp.round}/{inp.phase} is closing",
            )
        machine.check_upload_head(inp)
        return True

    def apply(self, machine: RoundMachine, inp: ClosingInput | Received) -> list[Effect]:
        if isinstance(inp, Progress):  # a shard saying again what it said (it restarted) changes nothing
            return self._place(machine, inp) if self.accepts(machine, inp) else []
        if isinstance(inp, Partials):
            return self._merge(machine, inp)
        assert isinstance(inp, ShardLost)
        return self._forget(machine, inp.shard)

    def gather(self, machine: RoundMachine) -> Gather:
        open_ = machine.phase
        assert open_ is not None
        assignment: dict[str, list[tuple[str, str]]] = {}
        for key, shard in sorted(open_.owners.items()):
            sender, _, kind = key.rpartition("/")
            assignment.setdefault(shard, []).append((sender, kind))
        return Gather(machine.round, open_.phase, assignment)

    def phase_state(self, machine: RoundMachine) -> dict[str, Any] | None:
        """The state the open phase began with, as the machine's `snapshot()` has it, for the shards (also
        mid-phase, after a restart: what the phase received is left out, and nothing a shard folds with - model,
        radii, rules - changes before the phase closes); None between phases. Without the clients and the round
        records, which a shard does not read and which grow with the fleet and the rounds."""
        s, open_ = machine.state, machine.phase
        if open_ is None:
            return None
        fresh = dataclasses.replace(open_, expected=set(), received={}, owners={})
        bare = dataclasses.replace(
            s, phase=fresh, clients={}, departed={}, leaving=set(), records=[], accepted={}, accepted_kinds={}
        )
        return machine.snapshot(bare)

    def _place(self, machine: RoundMachine, inp: Progress) -> list[Effect]:
        open_, kind = machine.phase, Upload(inp.kind)
        assert open_ is not None
        open_.received[inp.sender] = open_.received.get(inp.sender, set()) | {kind}
        open_.owners[f"{inp.sender}/{inp.kind}"] = inp.shard
        machine.state.current.uplink_bytes += inp.nbytes
        machine.count_upload(inp, inp.nbytes)
        return machine.close_if_complete()

    def _forget(self, machine: RoundMachine, shard: str) -> list[Effect]:
        """The closing phase without `shard`'s uploads: it owns none any more, and their senders count as if they
        had not sent them (a device that sent nothing else is not among the round's clients)."""
        open_ = machine.phase
        assert open_ is not None
        for key in [k for k, owner in open_.owners.items() if owner == shard]:
            sender, _, kind = key.rpartition("/")
            del open_.owners[key]
            kinds = open_.received.get(sender, set()) - {Upload(kind)}
            if kinds:
                open_.received[sender] = kinds
            else:
                open_.received.pop(sender, None)
        return []

    def _merge(self, machine: RoundMachine, inp: Partials) -> list[Effect]:
        open_ = machine.phase
        assert open_ is not None and machine.run is not None
        for _, part in sorted(inp.parts.items()):
            machine.run.merge(part)
        machine.run.finish()
        why, open_.closing = open_.closing, ""
        return machine.after_close(why)
