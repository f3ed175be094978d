"""An agent on a plain `Transport`: the simulator's carrier of its outcomes (no broker, no checkpoint).

The in-process simulator (broker_server/simulation/inprocess.py) and the Ray worker's recording transport
(broker_server/simulation/ray_worker.py) run every device as an `EdgeAgent` under a `LocalDevice`: it
subscribes the server's `config`, `public` and `round` topics, joins at once, hands every delivery to the
agent and carries its outcome out through the same `Carrier.carry` as the MQTT runner (edge_agent/core/outcome.py):
what it sends goes out in order, as the delivery's consequence (the in-process broker queues them behind it), and
the artifacts go to `on_artifacts`. The runner's other steps (edge_agent/ops/runner.py: checkpoints, a failed round on
the presence topic, retries, re-sends) have no place where nothing is lost and nothing restarts.
"""

from __future__ import annotations

from collections.abc import Callable

from edge_agent.core.agent import EdgeAgent
from edge_agent.core.artifacts import DeviceArtifacts
from edge_agent.core.outcome import Carrier, Outcome, Send
from edge_agent.ops.resend import secagg_step
from protofl import topics
from protofl.transport import Transport

__all__ = ["LocalDevice"]


class LocalDevice(Carrier):
    """`agent` over `transport`; `on_artifacts` gets the deployable artifacts an outcome carries."""

    def __init__(
        self, agent: EdgeAgent, transport: Transport, on_artifacts: Callable[[DeviceArtifacts], None] | None = None
    ) -> None:
        self.agent = agent
        self.transport = transport
        self.on_artifacts = on_artifacts
        self.last: Outcome = Outcome()  # the latest delivery's outcome

    def start(self) -> None:
        """Subscribe the server's topics, then join."""
        fed = self.agent.fed
        for topic in (topics.config(fed), topics.public(fed), topics.round_(fed)):
            self.transport.subscribe(topic, self.deliver)
        # Its own topic, for secure aggregation's steps only (edge_agent/core/secagg_device.py): what else the server
        # says
        # there (pace, re-send requests) is the MQTT runner's business.
        self.transport.subscribe(topics.down(fed, self.agent.client_id), self._own)
        self.carry(self.agent.join())

    def deliver(self, topic: str, payload: bytes) -> None:
        self.carry(self.agent.receive(topic, payload))

    def _own(self, topic: str, payload: bytes) -> None:
        if secagg_step(payload, self.agent.fed):
            self.deliver(topic, payload)

    def publish(self, send: Send) -> None:
        self.transport.publish(send.topic, send.payload, qos=1)

    def deploy(self, artifacts: DeviceArtifacts) -> None:
        if self.on_artifacts is not None:
            self.on_artifacts(artifacts)

    def carried(self, out: Outcome) -> None:
        self.last = out
