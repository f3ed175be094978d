"""A device's membership: what its presence topic says, and its place in a fleet's runs.

`Presence`: the retained `presence/<id>` message (a `Status`: online, offline, done, gave up, "cannot serve run X"),
its detail cut to the wire's text limit so that a long error never stops it; the same message is the connection's
last will ("offline"). `FleetMember`: a fleet (broker_server/fleet/fleet.py) runs one run after another on this device's
connection, its retained `fleet` topic naming the current run; between runs (or during a run this device does not
serve) the latest retained config, public set and round are held for the run they belong to, and each run this
device finished, or could not serve, is not served again. The runner (edge_agent/ops/runner.py) decides; these keep
the state. No torch, no numpy.
"""

from __future__ import annotations

from protofl import topics
from protofl.names import MAX_TEXT
from protofl.traits import Traits
from protofl.transport.mqtt import Will
from protofl.wire import Status, encode_message

__all__ = ["FleetMember", "Presence"]


class Presence:
    """This device's presence messages on `presence/<id>` (retained)."""

    def __init__(self, fed: str, client_id: str) -> None:
        self.fed, self.client_id = fed, client_id
        self.topic = topics.presence(fed, client_id)

    def will(self) -> Will:
        return Will(self.topic, self.payload("offline", "connection lost"))

    def payload(
        self, state: str, detail: str = "", round_: int = 0, phase: str = "", traits: Traits | None = None
    ) -> bytes:
        # The server refuses a longer detail (protofl.names.MAX_TEXT): a long error is cut, the presence still goes.
        cut = detail if len(detail) <= MAX_TEXT else detail[: MAX_TEXT - 3] + "..."
        msg = Status(state=state, detail=cut, traits=traits)
        return encode_message(msg, fed=self.fed, sender=self.client_id, round=round_, phase=phase)


class FleetMember:
    """Which of a fleet's runs this device serves, and what it holds for the next one."""

    def __init__(self, fed: str) -> None:
        self.fed = fed
        self.run: str | None = None  # the fleet's current run; None: no fleet seen (one federation: leave when it ends)
        self.done: list[str] = []  # the fleet's runs this device finished, or could not serve
        self.held: dict[str, bytes] = {}  # config/public/round seen between runs, handled when the run is ours
        self.agent_run = ""  # the fleet's run the agent serves ("" outside a fleet)
        self.refused = ""  # the fleet's run this device said it cannot serve (its retained presence says so)

    @property
    def serving(self) -> bool:
        """Whether the fleet's current run is one this device takes part in (not over for it)."""
        return self.run is None or (self.run != "" and self.run not in self.done)

    def hold(self, topic: str, payload: bytes, with_agent: bool) -> bool:
        """Between runs: keep the latest of each retained message (an empty one clears it: the run that ended
        cleared its own) for the run it belongs to; True when held (or empty), not handled."""
        if self.run is None:
            return False
        if self.serving and (with_agent or topic == topics.config(self.fed)):
            return not payload  # ours to handle (an empty one is the ended run's clear: nothing)
        if payload:
            self.held[topic] = payload
        else:
            self.held.pop(topic, None)
        return True

    def over(self, run: str) -> None:
        """`run` is over for this device (finished, or it cannot serve it): what was held for it goes."""
        if run and run not in self.done:
            self.done.append(run)
        self.held.clear()

    @property
    def checkpoint_key(self) -> str:
        """Whose checkpoint the agent keeps: the federation, or in a fleet the federation and its run."""
        return self.fed if not self.agent_run else f"{self.fed}.{self.agent_run}"
