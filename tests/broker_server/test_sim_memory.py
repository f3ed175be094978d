"""Issue 48: the simulator's processes keep the memory they free, so a batch's activations reuse the last batch's
pages instead of faulting fresh ones in (the simulator's system time)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# A 64 MB block (a batch's activation: above glibc's largest dynamic mmap threshold, 32 MB) allocated, written and
# freed twice; the minor page faults of the second time.
PROBE = """
import ctypes, ctypes.util, resource, sys
from broker_server.simulation.memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
for i in range(2):  # as torch allocates a tensor (numpy asks for huge pages, which hide the faults)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(64 << 20)
    ctypes.memset(block, 1, 64 << 20)
    libc.free(block)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_freed_batch_is_reused_without_faulting_its_pages_again() -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))

    def faults(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", PROBE, mode], env=env, capture_output=True, text=True, check=True)
        return int(out.stdout.strip())

    default, kept = faults("default"), faults("keep")
    assert default > 10_000, default  # 64 MB of fresh 4 KB pages: mapped again, faulted again
    assert kept < default // 10, (kept, default)
