"""`simulate --backend ray`, the worker side: a Ray actor that hosts some of the simulation's devices.

Each device is the ordinary `EdgeAgent` under the simulator's carrier (edge_agent/ops/local.py), over a
`RecordingTransport`: the worker has no broker. What a device subscribes to and publishes (its agent's
outcome) while it handles one delivery is recorded, in order, and returned to the driver, which replays it
on the one broker the aggregator uses (broker_server/simulation/ray_backend.py).
Messages cross as their encoded bytes in both directions; no model object leaves a worker. Nothing here
imports Ray: the driver wraps `DeviceWorker` with `ray.remote`.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from broker_server.simulation.deploy import DEVICE_ARTIFACTS, device_hook
from broker_server.simulation.spec import FED, SimulationSpec
from protofl.transport import Handler

# What an agent did while handling one delivery, in order: ("sub", pattern, handler index),
# ("pub", topic, payload, retain) or ("close",). Plain tuples of str/bytes/int: cheap to serialise.
Op = tuple[str, str, int] | tuple[str, str, bytes, bool] | tuple[str]


class RecordingTransport:
    """A device's transport inside a worker: it records instead of sending (the driver replays)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.ops: list[Op] = []
        self.handlers: list[Handler] = []
        self.closed = False

    def publish(self, topic: str, payload: bytes, *, retain: bool = False, qos: int = 1) -> None:
        if self.closed:
            raise RuntimeError(f"transport '{self.name}' is closed")
        self.ops.append(("pub", topic, bytes(payload), retain))

    def subscribe(self, pattern: str, handler: Handler) -> None:
        self.handlers.append(handler)
        self.ops.append(("sub", pattern, len(self.handlers) - 1))

    def close(self) -> None:
        self.closed = True
        self.ops.append(("close",))

    def take(self) -> list[Op]:
        """What was recorded since the last call."""
        ops, self.ops = self.ops, []
        return ops


class DeviceWorker:
    """Hosts devices (agents) for the driver; every method returns what the agent sent meanwhile."""

    def __init__(self, threads: int) -> None:
        import torch

        # torch's intra-op pool follows the worker's CPU share, so that workers do not oversubscribe a node.
        torch.set_num_threads(max(1, threads))
        self.spec = SimulationSpec()
        self.hook: Any = None
        # The run's official test set, one copy for all the devices here (as in-process, where they share one).
        self.test_set: tuple[np.ndarray, np.ndarray] | None = None
        self.agents: dict[str, Any] = {}
        self.transports: dict[str, RecordingTransport] = {}

    def reset(self, spec: SimulationSpec, num_classes: int) -> int:
        """Ready for a new run's devices (a worker outlives a run in a session that goes on: starting one
        costs seconds); returns this worker's process id."""
        self.spec, self.hook = spec, device_hook(spec, num_classes)
        self.test_set = None
        self.agents.clear()
        self.transports.clear()
        return os.getpid()

    def add(
        self,
        cid: str,
        arch: str | None,
        x_train: np.ndarray,
        y_train: np.ndarray,
        x_test: np.ndarray,
        y_test: np.ndarray,
        x_global: np.ndarray,
        y_global: np.ndarray,
        mean: tuple[float, ...],
        std: tuple[float, ...],
    ) -> list[Op]:
        """Build device `cid` on its data and start it (subscribe, join)."""
        from edge_agent.core.agent import ClientData, EdgeAgent
        from edge_agent.ops.local import LocalDevice

        # Arrays from Ray's object store are read-only views; the agent's tensors need their own memory.
        if self.test_set is None:
            self.test_set = (np.array(x_global), np.array(y_global))
        data = ClientData(
            x_train=np.array(x_train),
            y_train=np.array(y_train),
            x_test=np.array(x_test),
            y_test=np.array(y_test),
            x_global=self.test_set[0],
            y_global=self.test_set[1],
            mean=mean,
            std=std,
        )
        transport = RecordingTransport(cid)
        spec = self.spec
        agent = EdgeAgent(
            cid,
            FED,
            data,
            arch=arch,
            device=spec.device,
            eval_every=spec.eval_every,
            test_every=spec.test_every,
            extractor=spec.extractor,
            artifacts_at=DEVICE_ARTIFACTS if self.hook is not None else (),
        )
        self.agents[cid], self.transports[cid] = agent, transport
        LocalDevice(agent, transport, self.hook).start()
        return transport.take()

    def deliver(self, cid: str, index: int, topic: str, payload: bytes) -> list[Op]:
        """Hand one message to device `cid`'s subscription `index` (as a broker would)."""
        transport = self.transports[cid]
        if not transport.closed:
            transport.handlers[index](topic, payload)
        return transport.take()

    def dropped(self) -> dict[str, dict[str, int]]:
        """Each hosted device's dropped messages, by reason."""
        return {cid: dict(a.stats.dropped) for cid, a in self.agents.items()}

    def pid(self) -> int:
        """This worker's process id (what to kill to see a worker die)."""
        return os.getpid()
