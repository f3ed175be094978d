"""The simulator's processes keep the memory they free (issue 48: its system time).

glibc's malloc hands a freed block above its mmap threshold back to the kernel, and the next allocation of that
size maps fresh pages: every training and scoring batch's activations (tens of MB each) cost their pages' faults
again, most of the simulator's system time (a fifth of the FedProto pair's work, 2 rounds: 311,000-406,000 minor
faults, 1.4-1.6 s of system CPU; with these settings 124,000-128,000 and 0.8-0.9 s, peak memory unchanged:
bench/results/SIMSPEED.md). Raising the threshold (and the trim threshold, so the heap's top is not returned
either) keeps those blocks in the process for the next batch. glibc only; elsewhere nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

MMAP_THRESHOLD = 256 << 20  # blocks below this come from the heap and stay there when freed
TRIM_THRESHOLD = 1 << 30  # the heap's free top is returned past this only
TOP_PAD = 64 << 20  # the heap grows by at least this much at a time
# The same settings for a child process (glibc reads them at its start): the MQTT transport's device processes.
MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD),
    "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD),
    "MALLOC_TOP_PAD_": str(TOP_PAD),
}
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3  # glibc's mallopt parameters


def keep_freed_memory() -> bool:
    """Set this process's malloc to keep what it frees (see above); False where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(
        mallopt(param, value) == 1
        for param, value in (
            (_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
            (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            (_M_TOP_PAD, TOP_PAD),
        )
    )
