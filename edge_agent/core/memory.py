"""The device process's memory: what it holds (resident set), where it grew, and a device profile's limit.

What is measured is the process's resident set as the kernel keeps it in /proc/self/status: `VmRSS` (now)
and `VmHWM` (its peak since the process started, kept by the kernel, so no spike between two samples is
missed). Resident pages are what a device's RAM must hold: the Python heap and torch's allocations, and the
pages of torch's libraries the process has touched (file-backed: a real device's kernel could drop those under
pressure and read them again, at the cost of thrashing).

Why not RLIMIT_AS: torch reserves address space it never touches (a `join` on the cnn holds ~750 MB of
address space for ~290 MB resident with 2 threads, and every further thread adds an allocator arena of 64 MB),
so an address-space limit of a Pi 3's 1024 MB refuses models that fit there. A cgroup's memory.max would
count the right thing but needs root and a writable cgroup tree (no CI runner has one). So a device with a
profile (`join --profile rpi3`, and every device of `simulate --profiles`) runs a watchdog thread that reads
`VmHWM` every `PERIOD_S`: once the peak passes the profile's `memory_mb`, the device says so (log line and
its presence topic: the profile, the figure, the phase it was in) and exits with `EXIT_OVER_MEMORY`, as the
device's kernel would have killed it (bench/results/FOOTPRINT.md measures each architecture's peak).

`mark(phase)` records the resident set at the end of each phase of a device's life (imports, connect, data,
model, training, uploads, evaluation); `join -v` logs each, which is how bench/bench_footprint.py breaks a
real `join`'s peak down. No torch, no numpy: readable before torch is imported.
"""

from __future__ import annotations

import logging
import os
import resource
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("protofl.edge")
PERIOD_S = 0.05  # the watchdog's reading period (a peak is never missed: VmHWM keeps it)
EXIT_OVER_MEMORY = 3  # join's exit status when its process outgrew the device profile's memory
MB = 1024 * 1024


def _status() -> dict[str, int]:
    """/proc/self/status's Vm* and Rss* lines in bytes (empty where there is no /proc)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.startswith(("Vm", "Rss")) and value.strip().endswith("kB"):
                    out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def resident_bytes() -> int:
    """The resident set now (VmRSS)."""
    got = _status().get("VmRSS")
    return got if got is not None else peak_bytes()


def peak_bytes() -> int:
    """The resident set's peak since the process started (VmHWM; getrusage's ru_maxrss where no /proc)."""
    got = _status().get("VmHWM")
    if got is not None:
        return got
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB on Linux


MMAP_THRESHOLD = 128 * 1024  # glibc's own default, pinned (see pin_allocator)


def pin_allocator() -> bool:
    """Pin glibc's mmap threshold at its default (128 KiB) in this process, before torch allocates anything.

    glibc raises the threshold each time a large block is freed, after which torch's batch-sized buffers come from
    the heap, whose freed space is kept rather than given back: pinned, they are mapped and unmapped. Measured
    (bench/results/FOOTPRINT.md, the floor table): 10 training steps of the cnn peak 285 MB instead of 300-307, of
    resnet8 283 instead of 324. False where the C library is not glibc (nothing done)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-3, MMAP_THRESHOLD))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


@dataclass(frozen=True)
class Mark:
    phase: str
    resident: int  # bytes, at the end of the phase
    peak: int  # bytes, the process's peak up to then


_marks: list[Mark] = []
_lock = threading.Lock()


def mark(phase: str) -> Mark:
    """Record (and log at debug level) the resident set at the end of `phase`."""
    st = _status()
    m = Mark(phase, st.get("VmRSS", 0), st.get("VmHWM", 0) or peak_bytes())
    with _lock:
        _marks.append(m)
    log.debug("memory after %s: resident %.1f MB, peak %.1f MB", phase, m.resident / MB, m.peak / MB)
    return m


def last_phase() -> str:
    """The last phase marked (what the process was doing after it): 'start' before any."""
    with _lock:
        return _marks[-1].phase if _marks else "start"


class MemoryLimit:
    """A watchdog holding this process to `limit_mb` of resident memory (module docstring).

    `on_exceeded(message)` is called once, on the watchdog's thread, when the peak passes the limit (the runner
    says it on its presence topic there); then the process exits with EXIT_OVER_MEMORY. `exit` is for tests."""

    def __init__(
        self,
        limit_mb: float,
        profile: str,
        on_exceeded: Callable[[str], None] | None = None,
        exit: Callable[[int], object] = os._exit,
        period_s: float = PERIOD_S,
    ) -> None:
        if not limit_mb > 0:
            raise ValueError(f"a memory limit must be > 0 MB, got {limit_mb}")
        self.limit = int(limit_mb * MB)
        self.limit_mb = limit_mb
        self.profile = profile
        self.on_exceeded = on_exceeded
        self._exit = exit
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.exceeded: str | None = None  # the message, once the limit was passed

    def message(self, peak: int) -> str:
        return (
            f"over the memory of device profile '{self.profile}': this device's process reached "
            f"{peak / MB:.0f} MB resident (peak, VmHWM) after '{last_phase()}', more than the profile's "
            f"memory_mb {self.limit_mb:g}; on that device it would be killed for lack of memory. Use a smaller model "
            f"(`protofl-edge models` shows each architecture's measured peak), less data, or a larger profile"
        )

    def check(self) -> bool:
        """One reading; True (and the exit) where the peak passed the limit."""
        peak = peak_bytes()
        if peak <= self.limit or self.exceeded is not None:
            return False
        self.exceeded = self.message(peak)
        log.error("%s", self.exceeded)
        if self.on_exceeded is not None:
            try:
                self.on_exceeded(self.exceeded)
            except Exception:  # noqa: BLE001 - the exit must happen whatever the report did
                log.exception("could not report the memory overrun")
        for handler in logging.getLogger().handlers + log.handlers:
            handler.flush()
        self._exit(EXIT_OVER_MEMORY)
        return True

    def start(self) -> MemoryLimit:
        self.check()  # already over (the imports alone): said before anything else happens
        self._thread = threading.Thread(target=self._run, name="protofl-memory-limit", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            if self.check():
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(2 * self.period_s + 1)
