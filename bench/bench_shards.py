"""How far sharding can take the aggregator: per-upload cost of one aggregator, of one shard, and of the
coordinator placing the shards' progress, in one process, interleaved.

    python -m bench.bench_shards                           # tinyproto, 4000 uploads, 3 repeats
    python -m bench.bench_shards --preset protofl --uploads 8000 --out bench/results/SHARDS.md

Round 1's first phase of the preset (refprotofl: its prototype phase), every device's uploads of it.

Each upload is a real encoded message (seeded numpy devices, tests/broker_server/shard_helpers.py). Timed in CPU
seconds of this process (the machine is shared: wall time would measure the neighbours), with no broker and
no journal (so the figures are the aggregators' own work, the same for all three):
- `one aggregator`: `Aggregator.on_message` per upload (envelope, decode, plan and fold checks, clipping, fold);
- `one shard`: `Shard.on_message` per upload (the same, plus its progress entry), for the phase the
  coordinator opened;
- `coordinator`: `Coordinator.on_progress` for the same uploads in batches of 1000 (what N shards send it):
  it places each upload (membership, round, phase, duplicates) and closes the phase at quorum, which
  then the close alone: asking the shard, its partial encoded, sent, decoded, checked and merged.
With N shards each folds uploads/N, so the shards' side scales with N until the coordinator's rate (or the
broker) is the limit: the last column is that ceiling, coordinator rate / one aggregator's rate.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from broker_server.core.shell import Aggregator
from broker_server.scaleout.coordinator import Coordinator
from broker_server.scaleout.shard import Shard, shard_id
from protofl import topics
from protofl.presets import make_config
from protofl.transport import InProcessBroker
from protofl.wire import Join, encode_message, read_header


def _uploads(cfg: Any, n: int, fed: str) -> tuple[list[str], list[bytes]]:
    import numpy as np

    from tests.broker_server.shard_helpers import NumpyDevice

    clients = [f"d{i}" for i in range(n)]
    out = []
    sink = InProcessBroker().connect("sink")
    for i, c in enumerate(clients):
        dev = NumpyDevice(c, i + 1, cfg, sink)  # index 0 is the far device of the tests: none here
        phase = dev.plan.first_phase  # round 1's first phase: every upload it asks of a device
        for kind in dev.plan.sends(phase):
            up = dev.upload(kind, phase, 1, np.random.default_rng([i, 1]))
            out.append(encode_message(up, fed=fed, sender=c, round=1, phase=phase.value))
    return clients, out


def _closed(agg: Any) -> bool:
    """Round 1's first phase closed (at quorum)."""
    m = agg.machine
    return m.round > 1 or (m.phase is not None and m.phase.phase is not m.plan.first_phase)


def _joined(agg: Any, broker: InProcessBroker, clients: list[str], fed: str) -> None:
    agg.start()
    for c in clients:
        broker.connect(c).publish(topics.up(fed, c), encode_message(Join(arch="cnn", n_samples=10), fed=fed, sender=c))
    broker.pump()


def run_once(preset: str, n: int) -> dict[str, float]:
    fed = "bench"
    cfg = make_config(preset, min_clients=n, rounds=2)
    clients, payloads = _uploads(cfg, n, fed)
    out: dict[str, float] = {}

    broker = InProcessBroker()
    one = Aggregator(cfg, fed, broker.connect("server"), expected_clients=clients)
    _joined(one, broker, clients, fed)
    t0 = time.process_time()
    for p in payloads:
        one.on_message(topics.up(fed, read_header(p).sender), p)
    out["one aggregator"] = len(payloads) / (time.process_time() - t0)
    assert _closed(one) and not one.dropped, one.dropped

    broker = InProcessBroker()
    coord = Coordinator(cfg, fed, broker.connect("server"), shards=1, expected_clients=clients)
    shard = Shard(fed, broker.connect(shard_id(0)), shard=shard_id(0), batch=True)
    shard.start()
    _joined(coord, broker, clients, fed)
    progress: list[bytes] = []
    shard.transport = _Capture(progress)  # type: ignore[assignment]  # keep its progress for the coordinator
    t0 = time.process_time()
    for i, p in enumerate(payloads):
        shard.on_message(topics.up(fed, read_header(p).sender), p)
        if i % 1000 == 999:
            shard.flush()
    shard.flush()
    out["one shard"] = len(payloads) / (time.process_time() - t0)
    assert shard.folded == len(payloads) and not shard.dropped, shard.dropped
    shard.transport = broker.connect("shard-0-again")
    t0 = time.process_time()
    for p in progress:
        coord.on_progress(topics.shards(fed, "progress", shard_id(0)), p)
    placed = time.process_time() - t0
    assert coord.machine.phase is not None and coord.machine.phase.closing, "the phase did not close at quorum"
    t0 = time.process_time()
    broker.pump()  # the close request to the shard, its partial (encoded, decoded, checked) back, the merge
    merged = time.process_time() - t0
    assert _closed(coord) and not coord.machine.phase.closing, coord.dropped
    out["coordinator"] = len(payloads) / placed
    out["close ms"] = 1000 * merged
    return out


class _Capture:
    def __init__(self, into: list[bytes]) -> None:
        self.into = into

    def publish(self, topic: str, payload: bytes, *, retain: bool = False, qos: int = 1) -> None:
        if "/progress/" in topic:
            self.into.append(payload)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tinyproto", help="a preset, or several: tinyproto,protofl,refprotofl")
    ap.add_argument("--uploads", type=int, default=4000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    lines = [
        f"# Sharded aggregators: per-upload rates in CPU time ({args.uploads} devices' uploads, median of "
        f"{args.repeats})",
        "",
        f"{platform.machine()}, CPU seconds of one process (the machine is shared), no broker, no journal: "
        f"`python -m bench.bench_shards --preset {args.preset} --uploads {args.uploads}`.",
        "",
        "| preset | one aggregator uploads/s | one shard uploads/s | coordinator uploads/s | close (ask, "
        "partial, merge, next phase) | ceiling: coordinator / one aggregator |",
        "|---|---|---|---|---|---|",
    ]
    for preset in args.preset.split(","):
        runs = [run_once(preset, args.uploads) for _ in range(args.repeats)]
        m = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        lines.append(
            f"| {preset} | {m['one aggregator']:,.0f} | {m['one shard']:,.0f} | {m['coordinator']:,.0f} | "
            f"{m['close ms']:.1f} ms | {m['coordinator'] / m['one aggregator']:.1f}x |"
        )
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
