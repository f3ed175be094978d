"""What the live snapshot costs the thread that folds the uploads (issue 48), one round of real uploads in-process.

    python -m bench.bench_watch --n 3000,10000 --every 250

An aggregator with n joined devices (bench_aggregator's `Setup`: tinyproto, its journal, round 1 open) folds every
device's upload; every `--every` uploads the watch refreshes, two ways, alternating (the same process, the same
state):
- `full`: the previous way, all on the folding thread: every member's row built again, the snapshot encoded,
  handed to the board and written to status.json (`FederationObserver.snapshot` + `Snapshot.encode`);
- `incremental`: the folding thread takes the rows of the members whose uploads were applied since and the
  counters (`LiveWatch._hand_on`); the watch thread keeps the rows, builds, encodes (unchanged rows' bytes kept),
  hands on and writes the file.
CPU seconds of the calling thread (`time.thread_time`) per refresh, median; the watch thread's own build cost
beside it (it takes the GIL too, but not on the folding thread's path).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.bench_aggregator import Setup


def measure(n: int, every: int) -> dict[str, float]:
    from broker_server.watch.live import LiveWatch

    setup = Setup("tinyproto", n)
    state = Path(tempfile.mkdtemp(prefix="bench-watch-"))
    watch = LiveWatch(setup.agg, state_dir=state)
    watch.refresh()  # every row once
    full: list[float] = []
    inc: list[float] = []
    built: list[float] = []
    try:
        for i, p in enumerate(setup.uploads):
            setup.agg.on_message(setup.topics[i], p)
            if i % 64 == 63 and setup.durable is not None:  # (None: a run without the journal)
                setup.durable.sync()
            if i % every != every - 1 or i == len(setup.uploads) - 1:
                continue
            if (i // every) % 2:
                t = time.thread_time()
                snap = watch.observer.snapshot()
                body = snap.encode()
                watch.board.publish(snap, body)
                watch._write_status(body)
                full.append(time.thread_time() - t)
            else:
                version = watch.board.version
                t = time.thread_time()
                watch._hand_on(time.monotonic())
                inc.append(time.thread_time() - t)
                watch.board.wait_newer(version, 30.0)
                built.append(watch._built_cost)
    finally:
        watch.stopped()
        setup.close()
    return {
        "n": n,
        "full_ms": 1000 * statistics.median(full),
        "incremental_ms": 1000 * statistics.median(inc),
        "watch_thread_ms": 1000 * statistics.median(built),
        "refreshes": len(full) + len(inc),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", default="3000,10000")
    ap.add_argument("--every", type=int, default=250, help="uploads between refreshes")
    args = ap.parse_args()
    print(f"load average before {os.getloadavg()}")
    for n in (int(x) for x in args.n.split(",")):
        r = measure(n, args.every)
        print(
            f"n={n}: folding thread per refresh: full {r['full_ms']:.2f} ms, incremental {r['incremental_ms']:.3f} ms "
            f"({r['full_ms'] / r['incremental_ms']:.0f}x less); "
            f"the watch thread's build {r['watch_thread_ms']:.2f} ms; "
            f"{r['refreshes']:.0f} refreshes",
            flush=True,
        )
    print(f"load average after {os.getloadavg()}")


if __name__ == "__main__":
    main()
