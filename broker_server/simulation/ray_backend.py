"""`simulate --backend ray`: the simulation's devices on Ray workers, the aggregator in this process.

The aggregator, its round machine and the byte counting are the in-process run's, over the same
`InProcessBroker`. Every device gets a connection on that broker whose subscriptions forward each delivery
(the encoded bytes) to the Ray worker that hosts the device (broker_server/simulation/ray_worker.py);
what the device sent meanwhile comes back as bytes and is published on its connection.

Determinism: the in-process broker delivers one message at a time and a device's sends join the queue's
tail as it handles a message. Here deliveries to devices are sent off without waiting, so devices train
in parallel, and their sends are replayed in the order of the deliveries that caused them before anything
else is delivered to the aggregator (or when the queue runs dry). The queue therefore sees exactly the
in-process sequence, whatever the number of workers and whichever finishes first; every agent seeds its
training per client and round, so the report is the in-process one.

A worker whose process dies is started again (up to `ray_max_restarts` times) with fresh devices that
join again and pick up the retained state, as a rebooted device would; past that its devices are lost
and the run ends with an error naming them. Ray itself is imported only when such a run starts: it is
the optional extra `protofl-edge[ray]`.
"""

from __future__ import annotations

import logging
import math
import os
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

import numpy as np

from broker_server.core.shell import Aggregator
from broker_server.simulation.inprocess import client_data, make_aggregator
from broker_server.simulation.ray_worker import DeviceWorker, Op
from broker_server.simulation.report import Report, describe_drops
from broker_server.simulation.spec import FED, Federation, SimulationSpec, check_backend
from protofl import topics
from protofl.errors import ConfigError, ProtoFLError
from protofl.transport import Handler, InProcessBroker, InProcessTransport
from protofl.wire import Status, encode_message

log = logging.getLogger("protofl.simulate")

RAY_INSTALL_HINT = "pip install 'protofl-edge[ray]'"
# Starting a worker takes seconds (a process that imports torch); longer means the cluster has no room.
START_TIMEOUT_S = 300.0
SHARED_BYTES = 64 * 1024  # a payload this large that goes to many devices (a round's model) is stored once


class RayRunError(ProtoFLError, RuntimeError):
    """A Ray run that cannot go on: its workers find no room, or its devices were lost."""


class DevicesLost(RayRunError):
    """Devices whose Ray worker died more often than it may be restarted: the run cannot go on."""


@dataclass(frozen=True)
class DeviceResources:
    """Each device's share of a Ray node (`--device-resources cpu=1,gpu=0.25`)."""

    cpus: float = 1.0
    gpus: float = 0.0

    @classmethod
    def parse(cls, text: str) -> DeviceResources:
        values = {"cpu": 1.0, "gpu": 0.0}
        for item in filter(None, (s.strip() for s in text.split(","))):
            key, sep, value = item.partition("=")
            key = key.strip().lower()
            if not sep or key not in values:
                raise ConfigError(f"--device-resources: '{item}' is not cpu=N or gpu=N (e.g. cpu=1,gpu=0.25)")
            try:
                values[key] = float(value)
            except ValueError:
                raise ConfigError(f"--device-resources: {key}={value!r} is not a number") from None
            if not math.isfinite(values[key]) or values[key] < 0:
                raise ConfigError(f"--device-resources: {key} must be a number >= 0, got {value}")
        if values["cpu"] == 0 and values["gpu"] == 0:
            raise ConfigError("--device-resources: a device needs some cpu or gpu (e.g. cpu=1)")
        return cls(cpus=values["cpu"], gpus=values["gpu"])

    def slots(self, node: dict[str, float]) -> int:
        """How many devices fit on a node with these resources at once."""
        fits = [
            math.floor(node.get(name, 0.0) / share + 1e-9)
            for name, share in (("CPU", self.cpus), ("GPU", self.gpus))
            if share > 0
        ]
        return min(fits)

    def text(self) -> str:
        return f"cpu={self.cpus:g},gpu={self.gpus:g}"


def import_ray() -> Any:
    """The `ray` module, or a ConfigError that says what to install."""
    try:
        import ray
    except ImportError:
        raise ConfigError(f"--backend ray needs Ray, which is not installed: {RAY_INSTALL_HINT}") from None
    return ray


def check_ray(spec: SimulationSpec) -> DeviceResources:
    """The Ray run's options (see also spec.check_backend), and that Ray is installed."""
    check_backend(spec)
    res = DeviceResources.parse(spec.device_resources)
    import_ray()
    return res


def pool_size(nodes: list[dict[str, Any]], res: DeviceResources) -> int:
    """How many workers the cluster's live nodes hold at `res` each (a worker hosts devices one at a time)."""
    return sum(res.slots(n.get("Resources", {})) for n in nodes if n.get("Alive", True))


@dataclass
class _Slot:
    """One worker: its actor, how often it was started, and its devices (by index)."""

    actor: Any
    devices: list[int]
    incarnation: int = 0
    restarts: int = 0


@dataclass
class RayFleet:
    """The devices of a simulation on a pool of Ray workers, seen from the driver's broker."""

    ray: Any
    spec: SimulationSpec
    fed_data: Federation
    broker: InProcessBroker
    workers: int
    res: DeviceResources
    slots: list[_Slot] = field(default_factory=list)
    proxies: dict[int, InProcessTransport] = field(default_factory=dict)
    lost: list[str] = field(default_factory=list)
    # Deliveries (and starts) sent to workers, oldest first: (device index, worker, its incarnation, result).
    _pending: deque = field(default_factory=deque)
    _shared: dict[int, tuple[bytes, Any]] = field(default_factory=dict)

    def start(self, idle: list[Any]) -> None:
        """Take workers (`idle` ones of an earlier run first, else new), and on them start the devices (each
        subscribes and joins, in device order)."""
        self._data_refs = (self.ray.put(self.fed_data.test.normalized()), self.ray.put(self.fed_data.test.y))
        n = len(self.spec.client_ids)
        self.slots = [
            _Slot(idle.pop() if idle else None, [i for i in range(n) if i % self.workers == w])
            for w in range(self.workers)
        ]
        ready = [self._reset(slot) for slot in self.slots]
        done, waiting = self.ray.wait(ready, num_returns=len(ready), timeout=START_TIMEOUT_S)
        if waiting:
            raise RayRunError(
                f"Ray placed only {len(done)} of {len(ready)} workers ({self.res.text()} each) in "
                f"{START_TIMEOUT_S:.0f} s: the cluster's resources are taken (ray status shows by "
                "what); ask for less with --device-resources or --ray-workers"
            )
        for slot, ref in zip(self.slots, ready, strict=True):
            try:
                self.ray.get(ref)
            except self.ray.exceptions.RayActorError:  # an idle worker that died since its last run
                slot.actor = self._new_worker()
                self._reset(slot)
        for i in range(n):
            self._add(i)

    def _reset(self, slot: _Slot) -> Any:
        if slot.actor is None:
            slot.actor = self._new_worker()
        return slot.actor.reset.remote(self.spec, self.fed_data.cfg.num_classes)

    def _new_worker(self) -> Any:
        # Named, so that `ray list actors` shows whose workers these are.
        return (
            self.ray.remote(DeviceWorker)
            .options(
                num_cpus=self.res.cpus,
                num_gpus=self.res.gpus,
                max_restarts=0,
                max_task_retries=0,
                name=f"protofl-sim-worker-{uuid.uuid4().hex[:12]}",
            )
            .remote(max(1, int(self.res.cpus)))
        )

    def _add(self, i: int) -> None:
        """Device `i` on its worker, with a fresh connection on the broker."""
        d, w = client_data(self.fed_data, i, None), i % self.workers
        slot = self.slots[w]
        self.proxies[i] = self.broker.connect(self.spec.client_ids[i])
        ref = slot.actor.add.remote(
            self.spec.client_ids[i],
            self.fed_data.cfg.arch_for(i),
            d.x_train,
            d.y_train,
            d.x_test,
            d.y_test,
            *self._data_refs,
            d.mean,
            d.std,
        )
        self._pending.append((i, w, slot.incarnation, ref))

    def _deliver(self, i: int, w: int, incarnation: int, index: int, topic: str, payload: bytes) -> None:
        """A subscription of device `i`'s connection: send the message to its worker, without waiting."""
        slot = self.slots[w]
        if slot.incarnation != incarnation:
            return
        arg: Any = payload
        if len(payload) >= SHARED_BYTES:
            kept = self._shared.get(id(payload))
            if kept is None or kept[0] is not payload:
                kept = self._shared[id(payload)] = (payload, self.ray.put(payload))
            arg = kept[1]
        ref = slot.actor.deliver.remote(self.spec.client_ids[i], index, topic, arg)
        self._pending.append((i, w, incarnation, ref))

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def flush(self) -> int:
        """Wait for what was sent to the workers and replay the devices' sends in the order the messages
        were delivered; returns how many results came back."""
        n = 0
        while self._pending:
            i, w, incarnation, ref = self._pending.popleft()
            n += 1
            try:
                ops = self.ray.get(ref)
            except self.ray.exceptions.RayActorError as exc:
                if self.slots[w].incarnation == incarnation:
                    self._worker_died(w, exc)
                continue
            if self.slots[w].incarnation == incarnation:
                self._replay(i, w, incarnation, ops)
        self._shared.clear()
        return n

    def _replay(self, i: int, w: int, incarnation: int, ops: list[Op]) -> None:
        proxy = self.proxies[i]
        for op in ops:
            if op[0] == "pub":
                _, topic, payload, retain = cast(tuple[str, str, bytes, bool], op)
                proxy.publish(topic, payload, retain=retain)
            elif op[0] == "sub":
                _, pattern, index = cast(tuple[str, str, int], op)
                proxy.subscribe(pattern, partial(self._deliver, i, w, incarnation, index))
            else:
                proxy.close()

    def _worker_died(self, w: int, exc: BaseException) -> None:
        slot = self.slots[w]
        cids = [self.spec.client_ids[i] for i in slot.devices]
        slot.incarnation += 1
        for i in slot.devices:
            self.proxies[i].close()  # what was queued for the dead devices is not delivered
        if slot.restarts < self.spec.ray_max_restarts:
            slot.restarts += 1
            log.warning(
                "Ray worker %d (devices %s) died: %s; starting it again (%d/%d), its devices join again",
                w,
                ", ".join(cids),
                type(exc).__name__,
                slot.restarts,
                self.spec.ray_max_restarts,
            )
            slot.actor = self._new_worker()
            self._reset(slot)
            for i in slot.devices:
                self._add(i)
            return
        log.warning(
            "Ray worker %d (devices %s) died: %s; no restart left, its devices are lost",
            w,
            ", ".join(cids),
            type(exc).__name__,
        )
        for cid in cids:
            self.lost.append(cid)
            # What the broker does for a device that vanished: its last will says it is offline.
            will = encode_message(Status(state="offline", detail="Ray worker died"), fed=FED, sender=cid)
            self.broker.connect(f"{cid}-will").publish(topics.presence(FED, cid), will, retain=True)

    def restarts(self) -> dict[str, int]:
        """Each restarted worker's devices and how often their worker was started again."""
        return {self.spec.client_ids[i]: s.restarts for s in self.slots if s.restarts for i in s.devices}

    def dropped(self) -> dict[str, dict[str, int]] | None:
        """The live devices' dropped messages (None where a worker cannot say)."""
        out: dict[str, dict[str, int]] = {}
        try:
            for s in self.slots:
                out.update(self.ray.get(s.actor.dropped.remote(), timeout=30))
        except Exception:  # a dead worker: its devices cannot be asked
            return None
        return out

    def live_workers(self) -> list[Any]:
        """The workers that are still up (a worker that died was replaced, or its devices are lost)."""
        return [
            s.actor
            for s in self.slots
            if s.restarts <= self.spec.ray_max_restarts
            and not any(self.spec.client_ids[i] in self.lost for i in s.devices)
        ]


class _FlushFirst:
    """The aggregator's connection: before a message reaches the aggregator, the devices' replies to the
    messages delivered before it are in the queue, as in-process."""

    def __init__(self, inner: InProcessTransport, flush: Callable[[], int]) -> None:
        self.inner, self.flush = inner, flush

    def publish(self, topic: str, payload: bytes, *, retain: bool = False, qos: int = 1) -> None:
        self.inner.publish(topic, payload, retain=retain, qos=qos)

    def subscribe(self, pattern: str, handler: Handler) -> None:
        def first_flush(topic: str, payload: bytes) -> None:
            self.flush()
            handler(topic, payload)

        self.inner.subscribe(pattern, first_flush)

    def close(self) -> None:
        self.inner.close()


def connect(ray: Any, address: str | None) -> bool:
    """Join the cluster at `address` (auto, host:port, ray://...; `--ray-address`, else $RAY_ADDRESS as Ray
    itself reads it), or start a local Ray instance; returns
    whether this run started the connection (and must end it)."""
    if ray.is_initialized():
        return False  # the caller's own connection (a notebook, a test's cluster): keep it
    quiet = {"log_to_driver": True, "logging_level": logging.WARNING, "configure_logging": False}
    if address:
        try:
            ray.init(address=address, **quiet)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise ConfigError(
                f"--ray-address {address}: cannot join that Ray cluster ({exc}); start one with "
                "`ray start --head` or leave --ray-address out for a local instance"
            ) from None
    else:
        # "local": a new instance even where another Ray cluster runs on this machine (it is not ours to use).
        ray.init(address="local", num_cpus=os.cpu_count() or 1, include_dashboard=False, **quiet)
    return True


# Workers of sessions that outlive a run (the caller's own `ray.init`: a test module, a benchmark suite),
# by (Ray job, cpus, gpus): the next run on the same session takes them instead of starting processes.
_IDLE: dict[tuple[str, float, float], list[Any]] = {}


def run_on_ray(
    spec: SimulationSpec, fed_data: Federation, report: Report, initial_params: np.ndarray | None
) -> tuple[Aggregator, dict[str, Any]]:
    """Run the federation to its last round with the devices on Ray; returns the aggregator and what the
    report says of the Ray run (cluster, workers, restarts)."""
    res = check_ray(spec)
    ray = import_ray()
    started = connect(ray, spec.ray_address or os.environ.get("RAY_ADDRESS"))
    key = (ray.get_runtime_context().get_job_id(), res.cpus, res.gpus)
    idle = [] if started else _IDLE.pop(key, [])
    for other in list(_IDLE):  # idle workers of another size hold resources this run may need
        for actor in _IDLE.pop(other):
            ray.kill(actor)
    fleet: RayFleet | None = None
    keep: list[Any] = []  # workers for the session's next run
    try:
        room = pool_size(ray.nodes(), res)
        if room < 1:
            raise ConfigError(
                f"--device-resources {res.text()}: no node of the Ray cluster has that much "
                f"(cluster: {ray.cluster_resources()}); ask for less or add nodes"
            )
        workers = min(len(spec.client_ids), room, spec.ray_workers or room)
        broker = InProcessBroker()
        fleet = RayFleet(ray, spec, fed_data, broker, workers, res)
        agg = make_aggregator(
            spec, fed_data, report, _FlushFirst(broker.connect("server"), fleet.flush), initial_params
        )
        agg.start()
        fleet.start(idle)  # takes what it needs of `idle`
        _drive(agg, broker, fleet, report)
        info = {
            "address": spec.ray_address
            or os.environ.get("RAY_ADDRESS")
            or ("local" if started else "the caller's session"),
            "workers": workers,
            "device_resources": res.text(),
            "worker_torch_threads": max(1, int(res.cpus)),
            "nodes": sum(1 for n in ray.nodes() if n.get("Alive", True)),
            "restarts": fleet.restarts(),
        }
        if not started:
            keep = idle + fleet.live_workers()
        return agg, info
    finally:
        kept = {id(a) for a in keep}
        for actor in idle + ([s.actor for s in fleet.slots] if fleet is not None else []):
            if id(actor) not in kept:
                ray.kill(actor)  # a run that failed leaves its workers in an unknown state
        if keep:
            _IDLE[key] = keep
        if started:
            ray.shutdown()


def _drive(agg: Aggregator, broker: InProcessBroker, fleet: RayFleet, report: Report) -> None:
    """The in-process runner's loop, with the devices' replies flushed when the queue runs dry."""
    while not agg.finished:
        if broker.pump(1) == 0 and fleet.flush() == 0:
            where = f"simulation stalled in round {agg.round}: no messages left to deliver"
            if fleet.lost:
                raise DevicesLost(
                    f"{where}: device(s) {', '.join(fleet.lost)} lost with their Ray worker "
                    f"(restarted {fleet.spec.ray_max_restarts} time(s) at most; --ray-max-restarts)"
                )
            raise RuntimeError(f"{where} ({describe_drops(agg.dropped, fleet.dropped())})")
        report.poll(time.time(), force=broker.pending == 0 and fleet.in_flight == 0)
    while broker.pump() or fleet.flush():
        pass  # the final round message reaches every device (artifacts)
    report.poll(time.time(), force=True)
