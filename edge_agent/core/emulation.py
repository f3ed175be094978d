"""A device's profile at run time: its upload budget, and in simulation its emulated compute time.

Compute time, honestly. A simulated device trains on this machine, not on a Pi. What it spends is
measured as the CPU time of the thread that handles the round message (`time.thread_time`, torch at
one thread), from the moment the round message arrived to its last upload: CPU time, not wall time,
so that ten simulated devices sharing two cores do not inflate each other's compute. The device's
simulated compute time is that CPU time divided by its profile's `compute_factor`; its uploads are
held back until `arrival + compute / time_scale` (real seconds), and only then go onto the shaped
link. Where this machine is slower than that (the hold would be negative) the uploads go at once
and the overrun is reported (`overrun_s`): raise the compute factor's headroom by lowering
`--time-scale`.

Per round the device reports, in its metrics message's `extra`: `recv_t` and `release_t` (epoch
seconds, this machine's clock), `compute_cpu_s`, `compute_s` (simulated), `overrun_s`, and the
upload choice (`upload_budget`, `upload_bytes`, `upload_value_bytes`, `upload_k`, `upload_fits`).
In simulation the thread agents of one process train one at a time (edge_agent/ops/runner.py's lock) and this
machine may fall behind the time scale; which upload reaches the server first then depends on the lock's order and
the load, not on the devices. `ReleaseOrder`, shared by the simulator's thread agents, keeps a virtual clock and
releases their uploads in the order of their emulated release times on it, as a machine that keeps up would:

    virtual(t) = due of the latest upload released before real time t + (t - when it went)

(the identity before the first release): time passes at the real rate while links carry messages, and the lag
this machine built up training the devices one at a time is dropped at each release. A round message that came
off the wire at real time `recv_t` arrived at `virtual(recv_t)`; its upload is due at
`max(that, the device's previous release) + compute / time_scale` on the virtual clock, whatever real time the
training ended. An upload goes once the virtual clock has reached its due and no other device can release one due
earlier: none still trains (or holds unhandled in its inbox) a round message that arrived before that due, and no
held upload is due sooner. So the order holds across versions too: a fresh upload of the next version is not
kept behind a slow device's older one that is due after it, however long this machine took over the version.
The wait is this machine's, never the link's: the simulator measures the upload's link time from when it went
(`ReleaseOrder.went`) and counts how far the virtual clock had passed its due as overrun
(broker_server/simulation/timeline.py).

Compute from the profile alone (`sample_cost_s` > 0, simulate's `--sample-cost`): the device's compute is
`sample_cost_s x the samples it holds / compute_factor`, the same whatever this machine's load (CPU time per
training moves with the load); the round message's size is reported (`recv_bytes`) so that the simulator can time
the links from the profiles too (timeline.py's nominal links).
No torch, no numpy.
"""

from __future__ import annotations

import bisect
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from protofl.budget import upload_budget
from protofl.profiles import DeviceProfile, LinkProfile

log = logging.getLogger("protofl.edge")

Publish = Callable[[str, bytes, int], None]  # (topic, payload, qos)


@dataclass(frozen=True)
class Emulation:
    """What `--profile` and its switches say about this device."""

    device: DeviceProfile | None = None
    link: LinkProfile | None = None
    time_scale: float = 1.0
    emulate_compute: bool = False  # simulation: hold uploads for the profile's compute time
    adaptive: bool = True  # fit uploads to the link and the deadline (needs a link)
    upload_share: float = 0.8  # of the time left before the deadline, after compute and a round trip
    # simulation, thread agents: their uploads released in emulated order (one shared by all devices)
    order: ReleaseOrder | None = field(default=None, compare=False, hash=False)
    # simulation: compute from the profile, seconds of the reference machine's training per sample held (0: the
    # measured CPU time)
    sample_cost_s: float = 0.0

    @property
    def label(self) -> str:
        """What the device announces in its join (`rpi4+lte`)."""
        return "+".join(p.name for p in (self.device, self.link) if p is not None)


class RoundClock:
    """One round message's timing on the device: arrival, compute, release of its uploads."""

    def __init__(self, emulation: Emulation) -> None:
        self.em = emulation
        self.recv_t = 0.0
        self._cpu0 = 0.0
        self.release_t: float | None = None
        self.last_release = 0.0  # the previous round message's release: the device trains one at a time
        self.samples = 0  # the samples the device holds (the profile's compute with `sample_cost_s`)
        self.extra: dict[str, float] = {}

    def start(self, recv_t: float) -> float:
        """When the device starts training a round message that arrived at `recv_t` (real): not before it released
        the previous one's uploads (an asynchronous device still busy with an older version; timeline.py's rule).
        With the thread agents' release order, on its virtual clock."""
        arrived = self.em.order.virtual(recv_t) if self.em.order is not None else recv_t
        return max(arrived, self.last_release)

    def begin(self, recv_t: float, nbytes: int = 0, samples: int = 0) -> None:
        """A round message of `nbytes` arrived at `recv_t` (epoch s); its handling starts now on this thread, for a
        device holding `samples`."""
        self.recv_t = recv_t
        self._cpu0 = time.thread_time()
        self.release_t = None
        self.samples = samples
        self.extra = {"recv_t": recv_t, "recv_bytes": float(nbytes)}

    def compute_s(self, cpu: float | None = None) -> float:
        """Simulated compute so far: from the profile (`sample_cost_s`), else CPU time / compute factor (emulated),
        else wall time x scale."""
        em = self.em
        if em.emulate_compute and em.device is not None and em.sample_cost_s > 0:
            return em.sample_cost_s * self.samples / em.device.compute_factor
        if em.emulate_compute and em.device is not None:
            cpu = time.thread_time() - self._cpu0 if cpu is None else cpu
            return cpu / em.device.compute_factor
        return (time.time() - self.recv_t) * em.time_scale

    def budget(self, deadline: float) -> int | None:
        """Upload budget for a round whose deadline is `deadline` (the server's epoch clock)."""
        em = self.em
        if not em.adaptive or em.link is None:
            return None
        # `deadline` is the server's clock, `recv_t` ours: one machine in simulation; a field device
        # needs NTP-synchronised clocks for its budget to mean anything.
        left = (deadline - self.recv_t) * em.time_scale - self.compute_s() - em.link.rtt_ms / 1000
        return upload_budget(em.link.uplink_bytes_per_s, em.upload_share, left)

    def upload_release(self) -> float:
        """When the upload being published now may leave (epoch s): after the emulated compute."""
        if self.release_t is None:
            cpu = time.thread_time() - self._cpu0
            compute = self.compute_s(cpu)
            now = time.time()
            target = self.start(self.recv_t) + compute / self.em.time_scale if self.em.emulate_compute else now
            # With a release order the due is on its virtual clock, which holds the upload until then.
            self.release_t = self.last_release = target if self.em.order is not None else max(now, target)
            ready = self.em.order.virtual(now) if self.em.order is not None else now  # its training ended
            self.extra.update(
                compute_cpu_s=cpu, compute_s=compute, release_t=self.release_t, overrun_s=max(0.0, ready - target)
            )
        return self.release_t


class ReleaseOrder:
    """The simulator's thread agents' uploads, released in the order of their emulated release times on a virtual
    clock (the module's docstring). Thread-safe; a device that never reports done holds the others at most
    `max_wait_s` real seconds (counted in `forced`): a loaded machine trains the whole fleet one device at a time
    before the first upload of a round may go."""

    def __init__(self, max_wait_s: float = 300.0) -> None:
        self._cv = threading.Condition()
        self._training: dict[str, float] = {}  # device -> when the round message it handles arrived (virtual s)
        self._held: dict[str, list[float]] = {}  # device -> the release times of its messages not yet sent
        # device -> when a round message it has not begun to handle arrived (None: none waits); its thread may be
        # busy with another message (the runner's lock), and the upload it will train can still come first
        self._waiting: dict[str, Callable[[], float | None]] = {}
        # (device, due) -> how long past its due it went on the virtual clock (this machine's lag), and when it went
        # (real epoch s: its link time is measured from then)
        self.waited: dict[tuple[str, float], float] = {}
        self.went: dict[tuple[str, float], float] = {}
        self.max_wait_s = max_wait_s
        self.forced = 0
        # The virtual clock's anchors, in real order: (when an upload went, its due); virtual(t) runs from the
        # latest one before t. Only a release due no sooner than the latest anchor's due moves it.
        self._went: list[float] = []
        self._dues: list[float] = []

    def virtual(self, t: float) -> float:
        """The virtual clock at real time `t` (epoch s): the identity before the first release."""
        with self._cv:
            i = bisect.bisect_right(self._went, t) - 1
            return t if i < 0 else self._dues[i] + (t - self._went[i])

    def watch(self, device: str, waiting: Callable[[], float | None]) -> None:
        """`waiting()`: when (virtual) the round message `device` has not begun to handle arrived, or None."""
        with self._cv:
            self._waiting[device] = waiting

    def arrived(self, device: str, start: float) -> None:
        """`device` handles a round message it starts on at `start` (virtual): its upload may be due from then on."""
        with self._cv:
            self._training[device] = start

    def done(self, device: str) -> None:
        """`device` handled it (its uploads, if any, are held with their release times)."""
        with self._cv:
            self._training.pop(device, None)
            self._cv.notify_all()

    def hold(self, device: str, due: float) -> None:
        with self._cv:
            self._held.setdefault(device, []).append(due)

    def _blocked(self, device: str, due: float) -> bool:
        if any(t < due for d, t in self._training.items() if d != device):
            return True
        if any((t := w()) is not None and t < due for d, w in self._waiting.items() if d != device):
            return True
        return any(min(q) < due or (min(q) == due and d < device) for d, q in self._held.items() if q and d != device)

    def wait_turn(self, device: str, due: float) -> None:
        """Block until the virtual clock reaches `due` and no other device's upload can be due before this one's."""
        with self._cv:
            give_up = time.time() + self.max_wait_s + max(0.0, due - self.virtual(time.time()))
            while True:
                now = time.time()
                ahead = due - self.virtual(now)
                if ahead <= 0 and not self._blocked(device, due):
                    break
                if now >= give_up:
                    self.forced += 1
                    log.warning("%s: released after %.0f s held for other devices' uploads", device, self.max_wait_s)
                    break
                self._cv.wait(min(ahead, 0.5) if ahead > 0 else 0.5)
            late = self.virtual(now) - due
            if not self._dues or due >= self._dues[-1]:
                self._went.append(now)
                self._dues.append(due)
            self.went.setdefault((device, due), now)
            if late > 0:
                self.waited[(device, due)] = max(self.waited.get((device, due), 0.0), late)

    def sent(self, device: str, due: float) -> None:
        """`device`'s message held for `due` went out: the next in order may go."""
        with self._cv:
            q = self._held.get(device, [])
            if due in q:
                q.remove(due)
            self._cv.notify_all()


class HeldSender:
    """Publishes in order, each message not before its release time (a thread of its own, so the
    device's loop keeps serving its connection while its uploads are held)."""

    def __init__(self, publish: Publish, order: ReleaseOrder | None = None, device: str = "") -> None:
        self._publish = publish
        self._order, self._device = order, device
        self._queue: queue.SimpleQueue[tuple[float, str, bytes, int] | None] = queue.SimpleQueue()
        self._last = 0.0
        self._thread = threading.Thread(target=self._run, daemon=True, name="held-sender")
        self._thread.start()

    def submit(self, topic: str, payload: bytes, qos: int, not_before: float = 0.0) -> None:
        self._last = max(self._last, not_before)  # never overtake an earlier message
        if self._order is not None and self._last > 0:
            self._order.hold(self._device, self._last)
        self._queue.put((self._last, topic, payload, qos))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            due, topic, payload, qos = item
            if self._order is not None and due > 0:
                self._order.wait_turn(self._device, due)
            elif (wait := due - time.time()) > 0:
                time.sleep(wait)
            try:
                self._publish(topic, payload, qos)
            except Exception as exc:  # noqa: BLE001 - a closed transport at shutdown: nothing to send to
                log.warning("held upload on %s not sent: %s", topic, exc)
            finally:
                if self._order is not None and due > 0:
                    self._order.sent(self._device, due)

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (up to `timeout`), then stop."""
        self._queue.put(None)
        self._thread.join(timeout)
