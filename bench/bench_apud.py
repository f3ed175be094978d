"""Streaming APUD aggregation: uploads/s (decode + fold) and peak memory vs number of uploads.

    python -m bench.bench_apud --uploads 10000 --d 100000 --k 10000

Each upload is a real encoded `adapter` message (sparse values + mask or indices, chosen by the
codec); the aggregator path decodes it with the wire limits and folds it into `ApudAggregator` (as the server
does: `add_checked`, the decoder having checked the vector). It is read as the server reads it: by the compiled
reader where the `fast` extra is installed (protofl/wire/fast.py), else by the reference decoder (`--reference`
forces that). `uploads_per_cpu_s` is the one-core rate whatever
else the machine runs; `uploads_per_s` the wall-clock one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import tracemalloc

import numpy as np

from protofl.algorithms.apud import ApudAggregator, select_topk
from protofl.wire import ParamsUpload, decode_message, encode_message

try:  # the server's reader of uploads (trees before it had none)
    from protofl.wire.fast import read_upload, usable
except ImportError:
    read_upload = usable = None  # type: ignore[assignment]


def make_payloads(n_distinct: int, d: int, k: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    theta_g = rng.standard_normal(d).astype(np.float32)
    out = []
    for i in range(n_distinct):
        local = theta_g + rng.standard_normal(d).astype(np.float32) * 0.01
        sv = select_topk(local, theta_g, k)
        out.append(
            encode_message(
                ParamsUpload(update=sv, n_samples=100 + i, base_round=1),
                fed="bench",
                sender=f"c{i}",
                round=1,
                phase="train",
            )
        )
    return out


def run(uploads: int, d: int, k: int, distinct: int = 64, trace: bool = False, reference: bool = False) -> dict:
    payloads = make_payloads(distinct, d, k)
    from protofl.wire import DEFAULT_LIMITS

    fast = read_upload is not None and usable is not None and usable(DEFAULT_LIMITS) and not reference
    agg = ApudAggregator(np.zeros(d, dtype=np.float32))
    if trace:
        tracemalloc.start()
    # The server's path: a decoded upload's vector is not checked again (add_checked, where this tree has it).
    fold = getattr(agg, "add_checked", agg.add)
    start, cpu = time.perf_counter(), time.process_time()
    for i in range(uploads):
        got = read_upload(payloads[i % distinct]) if fast else None
        msg = got[1] if got is not None else decode_message(payloads[i % distinct])[1]
        assert isinstance(msg, ParamsUpload)  # every payload is one (make_payloads); as the server dispatches
        fold(msg.update, float(msg.n_samples))
    result = agg.result()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    peak = tracemalloc.get_traced_memory()[1] if trace else 0
    if trace:
        tracemalloc.stop()
    assert np.isfinite(result).all()
    return {
        "uploads": uploads,
        "d": d,
        "k": k,
        "seconds": round(elapsed, 3),
        "uploads_per_s": round(uploads / elapsed, 1),
        "uploads_per_cpu_s": round(uploads / cpu, 1),
        "payload_bytes": len(payloads[0]),
        "reader": "fast" if fast else "reference",
        "peak_traced_bytes": peak,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--uploads", type=int, default=10_000)
    ap.add_argument("--d", type=int, default=100_000)
    ap.add_argument("--k", type=int, default=10_000)
    ap.add_argument("--reference", action="store_true", help="read with the reference decoder, not the fast reader")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    speed = run(args.uploads, args.d, args.k, reference=args.reference)
    mem_small = run(args.uploads // 10, args.d, args.k, trace=True)
    mem_full = run(args.uploads, args.d, args.k, trace=True)
    report = {
        "machine": f"{platform.machine()} {os.cpu_count()} cpu, {platform.python_version()}",
        "throughput": speed,
        "peak_memory": {
            f"{mem_small['uploads']} uploads": mem_small["peak_traced_bytes"],
            f"{mem_full['uploads']} uploads": mem_full["peak_traced_bytes"],
        },
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
