"""The MQTT path's cost: round latency vs in-process, and aggregator messages/s through Mosquitto.

    python -m bench.bench_mqtt                      # both parts, 20 clients, prints a table
    python -m bench.bench_mqtt --json bench.json    # also write the figures

1. Round latency. The same 20-client federation (same seed, so the same training work) runs in-process,
   over Mosquitto with the agents as threads of one process (the same compute, serialised: the
   difference is the transport), and over Mosquitto with one OS process per agent (a real deployment
   on this machine: training runs in parallel on its cores). Latency of round r = close - open,
   as the aggregator records it; the median over rounds 2.. of all runs (round 1 warms up models).
2. Aggregator throughput. A publisher process plays N devices: it sends N joins, waits for the round
   message, then sends N prototype uploads (pre-encoded, QoS 1) as fast as it can. The aggregator
   service decodes, validates and folds each one. Uploads/s = N / (round close - round open). The same
   publisher against a plain subscriber gives the broker-only rate, and the in-process aggregator the
   decode + fold rate without any network.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
FED = "bench"


# -- part 1: round latency --------------------------------------------------------------------


def round_latency(
    clients: int, rounds: int, preset: str, dataset: str, broker_url: str, repeat: int = 2
) -> dict[str, Any]:
    import torch

    from broker_server.core.shell import Aggregator
    from broker_server.simulation import SimulationSpec, run_simulation
    from protofl.transport.broker_url import parse_broker_url

    torch.set_num_threads(1)  # like the agent processes; fastest for small batches on a shared box
    modes: tuple[tuple[str, dict[str, Any]], ...] = (
        ("inprocess", {}),
        ("mqtt_threads", dict(transport="mqtt", agents="thread")),
        ("mqtt_processes", dict(transport="mqtt", agents="process")),
    )
    lat: dict[str, list[float]] = {name: [] for name, _ in modes}
    walls: dict[str, list[float]] = {name: [] for name, _ in modes}
    # In-process and threads alternate `repeat` times (this box is shared: load drifts); processes once.
    plan = [m for _ in range(repeat) for m in modes[:2]] + [modes[2]]
    for name, extra in plan:
        spec = SimulationSpec(
            preset=preset,
            dataset=dataset,
            clients=clients,
            rounds=rounds,
            seed=0,
            broker=parse_broker_url(broker_url),
            timeout=900,
            **extra,
        )
        t0 = time.perf_counter()
        finished: list[Aggregator] = []
        run_simulation(spec, on_finish=finished.append)
        walls[name].append(time.perf_counter() - t0)
        per_round = [r.ended - r.started for r in finished[0].records]
        lat[name] += per_round[1:]  # round 1 warms up models and kernels
        print(f"  {name:15s} rounds {[round(x, 2) for x in per_round]} s, wall {walls[name][-1]:.1f} s", flush=True)
    out: dict[str, Any] = {}
    for name, _ in modes:
        out[name] = {
            "median_round_s": round(float(np.median(lat[name])), 3),
            "rounds_s": [round(x, 3) for x in lat[name]],
            "wall_s": [round(w, 1) for w in walls[name]],
        }
    base = out["inprocess"]["median_round_s"]
    for name in ("mqtt_threads", "mqtt_processes"):
        m = out[name]["median_round_s"]
        out[name]["overhead_s"] = round(m - base, 3)
        out[name]["overhead_pct"] = round(100 * (m - base) / base, 1)
    return out


# -- part 2: aggregator throughput ------------------------------------------------------------


def _payloads(n: int, classes: int, dim: int) -> tuple[list[bytes], list[bytes]]:
    from protofl.wire import Join, ProtoSet, ProtoUpload, encode_message

    rng = np.random.default_rng(0)
    joins, ups = [], []
    for i in range(n):
        cid = f"d{i:05d}"
        joins.append(
            encode_message(Join(arch="", n_samples=100, profile="", agent_version="bench"), fed=FED, sender=cid)
        )
        ps = ProtoSet(
            classes=np.arange(classes),
            values=rng.standard_normal((classes, dim)).astype(np.float32),
            counts=np.full(classes, 10),
            dt="f4",
        )
        ups.append(
            encode_message(
                ProtoUpload(local=ps, public=None, n_samples=100), fed=FED, sender=cid, round=1, phase="train"
            )
        )
    return joins, ups


def publisher_main(url: str, n: int, classes: int, dim: int, wait_round: bool) -> None:
    """Child process: play n devices. Prints the seconds spent publishing the uploads."""
    from protofl import topics
    from protofl.transport.mqtt import MqttTransport

    joins, ups = _payloads(n, classes, dim)
    t = MqttTransport(url, "bench-publisher", deliver="thread").connect(10)
    opened = threading.Event()
    t.subscribe(topics.round_(FED), lambda topic, payload: opened.set())
    if wait_round:
        for i, p in enumerate(joins):
            t.publish(topics.up(FED, f"d{i:05d}"), p)
        if not opened.wait(120):
            raise SystemExit("no round message within 120 s")
    t0 = time.perf_counter()
    for i, p in enumerate(ups):
        t.publish(topics.up(FED, f"d{i:05d}"), p)
    t.flush(300)
    print(f"{time.perf_counter() - t0:.4f}", flush=True)
    t.close()


def _spawn_publisher(url: str, n: int, classes: int, dim: int, wait_round: bool) -> subprocess.Popen[str]:
    cmd = [
        sys.executable,
        "-m",
        "bench.bench_mqtt",
        "--publisher",
        url,
        "--n",
        str(n),
        "--classes",
        str(classes),
        "--dim",
        str(dim),
    ] + (["--wait-round"] if wait_round else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)


def service_round(
    url: str, n: int, classes: int, dim: int, client_id: str | None = None, durability: Any = None
) -> Any:
    """One round of n publisher uploads through the aggregator service (with `durability`: settings.Durability);
    its RoundRecord."""
    from broker_server.service import AggregatorService, server_transport
    from broker_server.settings import Broker, Federation, Pacing
    from protofl.presets import make_config
    from protofl.transport.broker_url import parse_broker_url

    cfg = make_config("fedproto", rounds=1, num_classes=classes, proto_dim=dim, min_clients=n, round_timeout=600.0)
    ids = [f"d{i:05d}" for i in range(n)]
    service = AggregatorService(
        Federation(cfg, FED, expected_clients=ids),
        server_transport(
            Broker(parse_broker_url(url), client_id=client_id), FED, durable=bool(durability and durability.enabled)
        ),
        durability=durability,
        pacing=Pacing(log_grace=0.0),
    )
    service.start(10)
    pub = _spawn_publisher(url, n, classes, dim, wait_round=True)
    service.run(timeout=600)
    pub.communicate(timeout=60)
    service.close()
    rec = service.aggregator.records[0]
    assert rec.clients == ids, "every upload must have been folded in"
    return rec


def throughput(url: str, n: int, classes: int, dim: int) -> dict[str, Any]:
    from broker_server.core.shell import Aggregator
    from protofl import topics
    from protofl.presets import make_config
    from protofl.transport import InProcessBroker
    from protofl.transport.mqtt import MqttTransport

    joins, ups = _payloads(n, classes, dim)
    size = len(ups[0])
    cfg = make_config("fedproto", rounds=1, num_classes=classes, proto_dim=dim, min_clients=n, round_timeout=600.0)
    ids = [f"d{i:05d}" for i in range(n)]

    # a) the aggregator alone: decode + validate + fold, no network
    broker = InProcessBroker()
    agg = Aggregator(cfg, FED, broker.connect("server"), expected_clients=ids)
    agg.start()
    for i, p in enumerate(joins):
        agg.on_message(topics.up(FED, ids[i]), p)
    t0 = time.perf_counter()
    for i, p in enumerate(ups):
        agg.on_message(topics.up(FED, ids[i]), p)
    inproc = n / (time.perf_counter() - t0)
    assert agg.finished

    # b) the broker alone: the same publisher into a subscriber that only counts
    got = threading.Event()
    stamps: list[float] = []

    def counter(topic: str, payload: bytes) -> None:
        stamps.append(time.perf_counter())
        if len(stamps) == n:
            got.set()

    sub = MqttTransport(url, "bench-counter", deliver="thread").connect(10)
    sub.subscribe(topics.up_all(FED), counter)
    time.sleep(0.2)
    pub = _spawn_publisher(url, n, classes, dim, wait_round=False)
    if not got.wait(300):
        raise RuntimeError(f"the counting subscriber got {len(stamps)} of {n} messages")
    pub.communicate(timeout=60)
    sub.close()
    broker_only = (n - 1) / (stamps[-1] - stamps[0])  # first to last arrival at the subscriber

    # c) the aggregator service through the broker
    rec = service_round(url, n, classes, dim)
    return {
        "uploads": n,
        "upload_bytes": size,
        "inprocess_uploads_per_s": round(inproc),
        "broker_only_msgs_per_s": round(broker_only),
        "aggregator_uploads_per_s": round(n / (rec.ended - rec.started)),
        "aggregator_mb_per_s": round(n * size / (rec.ended - rec.started) / 2**20, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--preset", default="protofl")
    ap.add_argument("--dataset", default="synthetic:n=6000,n_test=200")
    ap.add_argument("--repeat", type=int, default=2, help="in-process / thread runs, alternated")
    ap.add_argument("--n", type=int, default=2000, help="devices (uploads) in the throughput part")
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--dim", type=int, default=512, help="prototype dimension of the throughput uploads")
    ap.add_argument("--skip-latency", action="store_true")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--publisher", help=argparse.SUPPRESS)
    ap.add_argument("--wait-round", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.publisher:
        publisher_main(args.publisher, args.n, args.classes, args.dim, args.wait_round)
        return

    from broker_server.ops.broker import MosquittoBroker

    result: dict[str, Any] = {
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_avg_1m": round(os.getloadavg()[0], 2),
        }
    }
    with MosquittoBroker(persistence=False) as broker:
        if not args.skip_latency:
            print(f"round latency, {args.clients} clients, {args.preset}, {args.dataset}:", flush=True)
            result["latency"] = round_latency(
                args.clients, args.rounds, args.preset, args.dataset, broker.url, args.repeat
            )
        if not args.skip_throughput:
            print(f"aggregator throughput, {args.n} uploads of {args.classes}x{args.dim} prototypes:", flush=True)
            result["throughput"] = throughput(broker.url, args.n, args.classes, args.dim)
            print("  " + json.dumps(result["throughput"]), flush=True)
    lat = result.get("latency")
    if lat:
        for name in ("mqtt_threads", "mqtt_processes"):
            print(
                f"{name}: median round {lat[name]['median_round_s']} s vs in-process "
                f"{lat['inprocess']['median_round_s']} s "
                f"-> overhead {lat[name]['overhead_s']:+.3f} s ({lat[name]['overhead_pct']:+.1f}%)"
            )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
