"""What the agent answers for one input: the device side of the server's inputs -> effects machine.

`EdgeAgent` (edge_agent/agent.py) takes its inputs - the federation's config, the public set, a round
message, a re-send request from the server, "join now" - and returns an `Outcome`: the messages to send
(each with its topic and its round/phase key, already encoded), whether the state a checkpoint holds
changed, a failed round and why, the inputs it refused, and the deployable artifacts of the moment. It
publishes nothing itself. Whoever carries the agent carries the outcome out: the MQTT runner
(edge_agent/runner.py: checkpoint, then publish - held back by the emulated compute time -, presence, retries,
logs), or the simulator's carrier over an in-process or recording transport (edge_agent/local.py). No torch,
no numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edge_agent.artifacts import DeviceArtifacts

__all__ = ["Drop", "Failure", "Outcome", "Send"]


@dataclass(frozen=True)
class Send:
    """One message for the device's `up/<id>` topic (QoS 1), encoded."""

    topic: str
    payload: bytes
    kind: str  # the wire kind: join, protos, adapter (a parameter vector), metrics
    round: int
    phase: str
    # Emulated compute (a device profile in simulation): not before this epoch time; 0: at once. A carrier
    # sends in order, so nothing behind a held message overtakes it.
    not_before: float = 0.0

    @property
    def key(self) -> tuple[int, str]:
        return self.round, self.phase


@dataclass(frozen=True)
class Failure:
    """A round that failed on the device (training diverged, bad data from the server); the agent is back to its
    state before the round and has not marked it handled, so the same round message can be tried again."""

    round: int
    phase: str
    reason: str


@dataclass(frozen=True)
class Drop:
    """An input the agent refused (counted in its `stats.dropped` under `reason`)."""

    reason: str
    detail: str


@dataclass(frozen=True)
class Outcome:
    """What one input made the agent do. The default: nothing."""

    sends: tuple[Send, ...] = ()
    # The state a local checkpoint holds changed (a round message was handled): save it before `sends` leave,
    # so that a restarted device never has sent work it no longer holds.
    changed: bool = False
    failure: Failure | None = None
    drops: tuple[Drop, ...] = ()
    configured: bool = False  # a config was adopted: a new model (a checkpoint may be loaded into it now)
    trained: bool = False  # a local training round ran
    resent: str = ""  # `sends` go out again (why: the round message came again, the server asked); else ""
    finished: bool = False  # the federation's final round message, seen for the first time
    artifacts: DeviceArtifacts | None = None  # what the device could deploy at this moment (where it keeps them)

    @property
    def nbytes(self) -> int:
        """The bytes `sends` put on the link."""
        return sum(len(s.payload) for s in self.sends)

    def kinds(self) -> list[str]:
        return [s.kind for s in self.sends]
