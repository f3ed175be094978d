"""The seam between the round machine and how its open phase closes (rounds.py): the `Closing` strategy, the
refusal every part of the machine raises (`Drop`), and the inputs and effects a strategy may bring of its own.

A strategy is injected into the machine (the sharded coordinator's, shard_closing.py) or chosen by it from the
config (secure aggregation, secagg_run.py); without either the machine folds here (`FoldHere`). The machine knows
no strategy's messages: it hands a strategy the inputs it owns (its `ClosingInput`s, and the messages of its
`kinds`), asks it whether the open phase is complete and who counts at its deadline, and tells it when a phase
opens or the machine is restored. Here, not in rounds.py, so that a strategy the machine chooses imports this
vocabulary without importing the machine (no import cycle: the machine is named for types only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from broker_server.core.rounds import Effect, Received, RoundMachine
    from protofl.wire import Head


class Drop(Exception):
    """An input the machine refuses: counted under `reason`, logged with `detail`, state unchanged."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


class ClosingInput:
    """An input of the closing strategy's own (the sharded coordinator's: a shard's progress, its partials, a shard
    lost; shard_closing.py): the machine hands it to its `Closing`."""


class ClosingEffect:
    """An effect of the closing strategy's own (the sharded coordinator's: ask the shards for their partials), for
    what is composed beside the shell (coordinator.py) to carry out."""


class Closing(Protocol):
    """How the open phase closes: `FoldHere` (one aggregator: its folds finish here), the sharded coordinator's
    `ShardClosing` (the phase waits for the shards' partials and merges them first, shard_closing.py), or secure
    aggregation's `SecAggClosing` (the phase runs its steps, then folds the unmasked sum here, secagg_run.py). A
    strategy may bring inputs and effects of its own (`ClosingInput`, `ClosingEffect`) and own message kinds
    (`kinds`); the machine hands it those inputs and returns its effects. It changes the machine only through
    `state`, `phase`, `run`, `check_upload_head`, `count_upload`, `close_if_complete` and `after_close`.

    The hooks below the first four have defaults (the machine's own rules), for a strategy that subclasses this."""

    # The message kinds (envelope kinds) the strategy owns: the machine screens, checks and applies them through
    # `screen`, `accepts` and `apply`, and knows nothing else of them.
    kinds: frozenset[str] = frozenset()

    def close(self, machine: RoundMachine, why: str) -> list[Effect]:
        """The open phase closes (`why`: quorum or deadline): finish it, or start completing it."""
        ...

    def accepts(self, machine: RoundMachine, inp: ClosingInput | Received) -> bool:
        """Raise Drop if `inp` is refused; else whether applying it changes state (as RoundMachine.accepts)."""
        ...

    def apply(self, machine: RoundMachine, inp: ClosingInput | Received) -> list[Effect]: ...

    def announce(self, machine: RoundMachine) -> list[Effect]:
        """After a restart: what a phase that is closing asks again."""
        ...

    def screen(self, machine: RoundMachine, head: Head) -> None:
        """Raise Drop for a message of `kinds` that its envelope alone shows is refused, before its body is parsed."""
        return None

    def begin(self, machine: RoundMachine) -> None:
        """A phase opened (`machine.phase`), or the machine was restored (mid-phase, or None between phases): what
        the strategy keeps of the open phase starts afresh. It holds nothing at a boundary, where snapshots are
        taken; a journal replay brings the rest back, input by input."""
        return None

    def progress(self, machine: RoundMachine) -> list[Effect] | None:
        """The open phase received something or lost a member: the strategy's own effects where it decides when
        the phase moves on, None where the machine's rules (quorum, target, buffer) decide."""
        return None

    def overdue(self, machine: RoundMachine) -> bool:
        """At the open phase's deadline with fewer than the floor: whether the phase closes all the same (its
        strategy then folds what it can, or nothing), because no one new can join it; False: it waits another
        deadline for devices to come, as a plain phase does."""
        return False

    def ready(self, machine: RoundMachine) -> list[str] | None:
        """At the open phase's deadline: the clients that count toward the floor (None: those that sent what the
        phase asks of them)."""
        return None


class FoldHere(Closing):
    """One aggregator: the uploads were folded here, so a closing phase is finished at once."""

    def close(self, machine: RoundMachine, why: str) -> list[Effect]:
        assert machine.run is not None
        machine.run.finish()
        return machine.after_close(why)

    def accepts(self, machine: RoundMachine, inp: ClosingInput | Received) -> bool:
        raise Drop("unexpected_kind", f"a shard's {type(inp).__name__.lower()}: this aggregator is not sharded")

    def apply(self, machine: RoundMachine, inp: ClosingInput | Received) -> list[Effect]:
        return []

    def announce(self, machine: RoundMachine) -> list[Effect]:
        return []
