"""What the agent answers for one input: the device side of the server's inputs -> effects machine.

`EdgeAgent` (edge_agent/core/agent.py) takes its inputs - the federation's config, the public set, a round
message, a re-send request from the server, "join now" - and returns an `Outcome`: the messages to send
(each with its topic and its round/phase key, already encoded), whether the state a checkpoint holds
changed, a failed round and why, the inputs it refused, and the deployable artifacts of the moment. It
publishes nothing itself. Whoever carries the agent carries each outcome out through `Carrier.carry`, in one
order - the checkpoint, a checkpoint loaded into a new model, the sends, the artifacts, a failed round, the log -
whatever the input was: the MQTT runner (edge_agent/ops/runner.py: a checkpoint on disk before the sends, which its
outbox holds back by the emulated compute time, a failed round on the presence topic with a retry planned, its
log lines), or the simulator's `LocalDevice` over an in-process or recording transport (edge_agent/ops/local.py:
the sends and the artifacts; nothing is lost there and nothing restarts). No torch, no numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edge_agent.core.artifacts import DeviceArtifacts

__all__ = ["Carrier", "Drop", "Failure", "Outcome", "Send"]


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
    # A phase this device leaves (why: `reason`), told the server on its presence (no retry: a refusal).
    left: Failure | None = None
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


class Carrier:
    """Carries an agent's outcomes out: `carry` is the one path, the same for every input (join, config, public
    set, round message, a step of secure aggregation, a re-send request) and every carrier; a carrier says how
    each effect is done by overriding its step. The defaults do nothing (a carrier that keeps no state on disk,
    has nobody to tell of a failure, writes no artifacts), except `publish`, which every carrier must do."""

    def carry(self, out: Outcome) -> None:
        if out.changed:
            self.checkpoint()  # first: an upload never leaves before the state that made it is kept
        if out.configured:
            self.configured()
        for send in out.sends:
            self.publish(send)
        if out.artifacts is not None:
            self.deploy(out.artifacts)
        if out.failure is not None:
            self.failed(out.failure)
        if out.left is not None:
            self.left(out.left)
        self.carried(out)

    def checkpoint(self) -> None:
        """Keep the state the agent holds now (a round message was handled)."""

    def configured(self) -> None:
        """The agent adopted a config and built a new model: a checkpoint may be loaded into it now."""

    def publish(self, send: Send) -> None:
        """One message, in the outcome's order (`send.not_before`: not before then)."""
        raise NotImplementedError

    def deploy(self, artifacts: DeviceArtifacts) -> None:
        """What the device could deploy at this moment."""

    def failed(self, failure: Failure) -> None:
        """A round failed here: the agent is as it was before it (say so, plan a retry)."""

    def left(self, left: Failure) -> None:
        """This device leaves a phase, refusing what the server asked of it (say so where the server hears it)."""

    def carried(self, out: Outcome) -> None:
        """The outcome was carried out (say what it did)."""
