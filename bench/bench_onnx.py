"""ONNX benchmark: extraction speed (torch vs onnxruntime fp32 / int8) and the frozen-backbone mode.

    python bench/bench_onnx.py                 # the figures in the issue note (a few minutes, 2 cores)
    python bench/bench_onnx.py --quick         # a smoke run
    python bench/bench_onnx.py --json out.json
    python bench/bench_onnx.py --cpu-time --skip-extraction --skip-federation   # parts 3 and 4 (ONNX.md)

Part 1 times prototype-space extraction (features graph: backbone + stem + adapter) of `cnn` and
`resnet8` on real Fashion-MNIST test images at batch 1 and 64, torch vs onnxruntime fp32 vs static
int8, for each thread count given, and the cost of one (re-)export as the OnnxExtractor pays it per round.
Part 2 runs the same federation (Fashion-MNIST, Dirichlet split, same seed) with a trainable and with a
frozen backbone and reports per-round on-device training time and accuracy; a third run repeats the
trainable one with the onnx extractor, to show what it costs and that it changes nothing.

``--cpu-time`` runs parts 3 and 4, timed in CPU seconds of the calling thread (``time.thread_time``), one
intra-op thread for both torch and onnxruntime: on a machine shared with other work, wall time measures the
neighbours as much as the model, CPU time of a one-thread computation does not (cache contention aside).
Part 3 compares onnxruntime's options on every built-in architecture at batch 1 and 64: the session as the
device builds it (edge_agent.inference.onnx_runtime.session: ORT_ENABLE_ALL), ORT_ENABLE_EXTENDED (without the layout
transforms of ENABLE_ALL), the dynamo against the TorchScript exporter, a graph exported with a fixed batch
instead of a dynamic axis, and denormals flushed to zero. Part 4 times a device's prototype extraction after
training, per round, as each extractor pays it: torch's `trainer.embed` against the onnx extractor's
re-export + session + run, for the number of training images a device holds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import numpy as np  # noqa: E402
import torch  # noqa: E402

from broker_server.core.shell import Aggregator  # noqa: E402
from broker_server.simulation import SimulationSpec, prepare  # noqa: E402
from edge_agent.core.agent import ClientData, EdgeAgent  # noqa: E402
from edge_agent.inference.onnx_export import export_onnx  # noqa: E402
from edge_agent.ops.local import LocalDevice  # noqa: E402
from edge_agent.training.models import build_model  # noqa: E402
from export.bench import bench_model, speedups  # noqa: E402
from export.quantize import quantize_model  # noqa: E402
from protofl.data import load_images  # noqa: E402
from protofl.transport import InProcessBroker  # noqa: E402
from protofl.wire import Metrics  # noqa: E402


def extraction(archs: list[str], threads: list[int], iters: int) -> list[dict[str, Any]]:
    x, _, ds = load_images("fashion-mnist", "test", 256)
    calib, _, _ = load_images("fashion-mnist", "train", 512, seed=1)
    out = []
    for arch in archs:
        model = build_model(arch, (1, 28, 28), 10, seed=0)
        with tempfile.TemporaryDirectory() as tmp:
            fp32 = export_onnx(model, Path(tmp) / "fp32.onnx", mean=ds.mean, std=ds.std)
            legacy = export_onnx(model, Path(tmp) / "legacy.onnx", exporter="torchscript")
            int8 = quantize_model(fp32.path, Path(tmp) / "int8.onnx", "static", calib)
            for n in threads:
                rows = bench_model(model, {"onnx-fp32": fp32.path, "onnx-int8": int8}, x, (1, 64), n, iters)
                gains = speedups(rows)
                for r in rows:
                    d = r.as_dict() | {"arch": arch, "speedup_vs_torch": round(gains.get((r.backend, r.batch), 1.0), 2)}
                    out.append(d)
                    print(
                        f"  {arch:8s} {r.backend:9s} threads {n} batch {r.batch:3d}: {r.latency_ms:8.3f} ms "
                        f"{r.throughput:9.0f} img/s  x{d['speedup_vs_torch']:.2f} vs torch",
                        flush=True,
                    )
        out.append(
            {"arch": arch, "export_s_dynamo": round(fp32.seconds, 2), "export_s_torchscript": round(legacy.seconds, 2)}
        )
        print(f"  {arch:8s} one export: dynamo {fp32.seconds:.2f} s, torchscript {legacy.seconds:.2f} s", flush=True)
    return out


def cpu_ms(fn: Any, iters: int, warmup: int = 3) -> float:
    """Median CPU milliseconds of the calling thread per ``fn()`` (time.thread_time)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(1, iters)):
        t = time.thread_time()
        fn()
        times.append(time.thread_time() - t)
    return 1e3 * statistics.median(times)


def ort_options(archs: list[str], iters: int) -> list[dict[str, Any]]:
    """Part 3: torch against onnxruntime variants, CPU ms per batch, one thread each."""
    import onnxruntime as ort

    from edge_agent.inference.onnx_export import graph_of
    from edge_agent.inference.onnx_runtime import session

    def variant(path: Path, level: Any = None, entries: tuple[tuple[str, str], ...] = ()) -> Any:
        o = ort.SessionOptions()
        o.graph_optimization_level = level
        o.intra_op_num_threads, o.inter_op_num_threads, o.log_severity_level = 1, 1, 3
        for k, v in entries:
            o.add_session_config_entry(k, v)
        return ort.InferenceSession(str(path), o, providers=["CPUExecutionProvider"])

    torch.set_num_threads(1)
    x, _, _ = load_images("fashion-mnist", "test", 64)
    out = []
    for arch in archs:
        model = build_model(arch, (1, 28, 28), 10, seed=0).eval()
        graph = graph_of(model, "features")
        with tempfile.TemporaryDirectory() as tmp:
            ts = export_onnx(model, Path(tmp) / "ts.onnx", exporter="torchscript").path
            dyn = export_onnx(model, Path(tmp) / "dyn.onnx", exporter="dynamo").path
            for b in (1, 64):
                xb = np.ascontiguousarray(x[:b])
                tb = torch.from_numpy(xb)
                fixed = Path(tmp) / f"fixed{b}.onnx"
                with torch.no_grad():  # the TorchScript exporter without a dynamic axis: batch b only
                    torch.onnx.export(graph, (tb,), str(fixed), dynamo=False, opset_version=17, input_names=["x"])

                def run_torch(tb: torch.Tensor = tb, graph: Any = graph) -> None:
                    with torch.inference_mode():
                        graph(tb)

                row: dict[str, Any] = {"arch": arch, "batch": b, "torch": cpu_ms(run_torch, iters)}
                sessions = {
                    "device session (ALL, torchscript)": session(ts, 1),
                    "ENABLE_EXTENDED": variant(ts, ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED),
                    "dynamo export": session(dyn, 1),
                    "fixed batch": session(fixed, 1),
                    "denormals as zero": variant(
                        ts, ort.GraphOptimizationLevel.ORT_ENABLE_ALL, (("session.set_denormal_as_zero", "1"),)
                    ),
                }
                for name, sess in sessions.items():
                    feed = {sess.get_inputs()[0].name: xb}
                    row[name] = cpu_ms(lambda s=sess, f=feed: s.run(None, f), iters)
                out.append(row)
                print(
                    f"  {arch:12s} batch {b:2d}: torch {row['torch']:8.2f} ms | "
                    + " | ".join(f"{k} {row[k]:.2f} (x{row['torch'] / row[k]:.2f})" for k in sessions),
                    flush=True,
                )
    return out


def round_extraction(archs: list[str], sizes: list[int], rounds: int) -> list[dict[str, Any]]:
    """Part 4: a round's extraction on the device after training, CPU ms (torch vs re-export + onnxruntime)."""
    from edge_agent.inference.extractor import OnnxExtractor, TorchExtractor

    torch.set_num_threads(1)
    out = []
    for arch in archs:
        for n in sizes:
            x, _, _ = load_images("fashion-mnist", "train", n, seed=2)
            model = build_model(arch, (1, 28, 28), 10, seed=0)
            t_ext, o_ext = TorchExtractor(model), OnnxExtractor(model, threads=1, batch_size=64)
            cost: dict[str, list[float]] = {"torch": [], "onnx": []}
            z_t = z_o = np.zeros(0)
            for _ in range(rounds):
                with torch.no_grad():  # a round's training changed the weights: the onnx extractor re-exports
                    next(model.parameters()).add_(1e-3)
                for name, ext in (("torch", t_ext), ("onnx", o_ext)):
                    t = time.process_time()
                    z = ext.embed(x)
                    cost[name].append(1e3 * (time.process_time() - t))
                    z_t, z_o = (z, z_o) if name == "torch" else (z_t, z)
            row: dict[str, Any] = {
                "arch": arch,
                "images": n,
                "torch_ms": statistics.median(cost["torch"]),
                "onnx_ms": statistics.median(cost["onnx"]),
                "exports": o_ext.exports,
                "export_ms_mean": 1e3 * o_ext.export_seconds / max(1, o_ext.exports),
                "max_abs_diff": float(np.abs(z_t - z_o).max()),
            }
            out.append(row)
            print(
                f"  {arch:12s} {n:5d} images: torch {row['torch_ms']:8.1f} ms, onnx (export + run) "
                f"{row['onnx_ms']:8.1f} ms (x{row['torch_ms'] / row['onnx_ms']:.2f}), "
                f"export {row['export_ms_mean']:.0f} ms wall, |dz| {row['max_abs_diff']:.1e}",
                flush=True,
            )
    return out


def federation(backbone: str, extractor: str, args: argparse.Namespace) -> dict[str, Any]:
    spec = SimulationSpec(
        preset=args.preset,
        dataset="fashion-mnist",
        clients=args.clients,
        alpha=args.alpha,
        rounds=args.rounds,
        seed=0,
        train_limit=args.train_limit,
        test_limit=args.test_limit,
        archs=(args.arch,),
        overrides={"backbone": backbone},
    )
    fed = prepare(spec)
    cfg, train, test, split = fed.cfg, fed.train, fed.test, fed.split
    metrics: dict[int, dict[str, Metrics]] = defaultdict(dict)
    broker = InProcessBroker()
    ids = [f"dev-{i:02d}" for i in range(spec.clients)]
    agg = Aggregator(
        cfg,
        "bench",
        broker.connect("server"),
        public=fed.public_set(),
        expected_clients=ids,
        on_metrics=lambda c, r, m, n: metrics[r].__setitem__(c, m),
    )
    x_test = test.normalized()
    agents = []
    for i, cid in enumerate(ids):
        part = split.clients[i]
        data = ClientData(
            train.normalized(part.train),
            train.y[part.train],
            train.normalized(part.test),
            train.y[part.test],
            x_test,
            test.y,
            train.mean,
            train.std,
        )
        agents.append(EdgeAgent(cid, "bench", data, arch=args.arch, extractor=extractor))
    agg.start()
    for a in agents:
        LocalDevice(a, broker.connect(a.client_id)).start()
    start = time.perf_counter()
    while not agg.finished:
        if broker.pump(1) == 0:
            raise RuntimeError(f"federation stalled in round {agg.round}")
    broker.pump()
    wall = time.perf_counter() - start
    rows = []
    for r in sorted(metrics):
        ms = list(metrics[r].values())
        n_local = sum(m.n_local for m in ms)
        rows.append(
            {
                "round": r,
                "local_acc": round(sum(m.correct_local for m in ms) / n_local, 4) if n_local else None,
                "global_acc": round(float(np.mean([m.correct_test / m.n_test for m in ms if m.n_test])), 4),
                "train_s_per_device": round(statistics.mean(m.train_s for m in ms), 3),
            }
        )
    cache_s = [a._frozen.seconds for a in agents if a._frozen.h is not None]
    exports = [getattr(a._extractor, "exports", 0) for a in agents]
    return {
        "backbone": backbone,
        "extractor": extractor,
        "rounds": rows,
        "wall_s": round(wall, 1),
        "h_cache_s_per_device": round(statistics.mean(cache_s), 2) if cache_s else None,
        "h_cache_backend": agents[0]._frozen.used or None,
        "onnx_exports_per_device": statistics.mean(exports) if extractor == "onnx" else None,
        "clients": spec.clients,
        "samples_per_device": int(np.mean([len(c.train) for c in split.clients])),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a smoke run (fewer iterations, rounds and samples)")
    p.add_argument("--threads", default="1,2", help="thread counts for part 1, comma-separated")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--preset", default="fedproto")
    p.add_argument("--arch", default="cnn", help="architecture of the federation in part 2")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--train-limit", type=int, default=12000)
    p.add_argument("--test-limit", type=int, default=2000)
    p.add_argument("--skip-extraction", action="store_true", help="part 2 only")
    p.add_argument("--skip-federation", action="store_true", help="part 1 only")
    p.add_argument("--cpu-time", action="store_true", help="parts 3 and 4: onnxruntime options, per-round extraction")
    p.add_argument("--archs", default="cnn,mlp,resnet8,mobilenetv2,resnet18", help="architectures of parts 3 and 4")
    p.add_argument("--images", default="600,1800", help="part 4: a device's training images, comma-separated")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if args.quick:
        args.iters, args.rounds, args.train_limit, args.test_limit = 5, 2, 3000, 500
    torch.set_num_threads(1)  # part 2: one thread per simulated device, as on a small board
    import onnxruntime

    # Other processes on a shared machine slow both backends unevenly: the load average is recorded.
    report: dict[str, Any] = {
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "onnxruntime": onnxruntime.__version__,
            "load_avg_start": list(os.getloadavg()),
        }
    }
    if not args.skip_extraction:
        print(f"Part 1: features extraction, torch vs onnxruntime (median of {args.iters} runs)", flush=True)
        report["extraction"] = extraction(["cnn", "resnet8"], [int(t) for t in args.threads.split(",")], args.iters)
    if args.cpu_time:
        archs = args.archs.split(",")
        print(f"Part 3: onnxruntime options, CPU ms per batch (median of {args.iters}), one thread", flush=True)
        report["options"] = ort_options(archs, args.iters)
        print("Part 4: a round's extraction after training, CPU ms (median of 3 rounds), one thread", flush=True)
        report["per_round"] = round_extraction(archs, [int(v) for v in args.images.split(",")], 3)
    if not args.skip_federation:
        print(
            f"Part 2: {args.preset}, {args.clients} x {args.arch}, Fashion-MNIST ({args.train_limit} train), "
            f"alpha {args.alpha}, {args.rounds} rounds",
            flush=True,
        )
        runs = []
        for backbone, extractor in (("train", "torch"), ("frozen", "torch"), ("train", "onnx")):
            run = federation(backbone, extractor, args)
            runs.append(run)
            last = run["rounds"][-1]
            per_round = statistics.mean(r["train_s_per_device"] for r in run["rounds"])
            print(
                f"  backbone={backbone:6s} extractor={extractor:5s}: train {per_round:.3f} s/round/device, "
                f"final local acc {last['local_acc']:.4f}, global acc {last['global_acc']:.4f}, "
                f"wall {run['wall_s']} s, h cache {run['h_cache_s_per_device']} s ({run['h_cache_backend']}), "
                f"exports/device {run['onnx_exports_per_device']}",
                flush=True,
            )
            for r in run["rounds"]:
                print(
                    f"      round {r['round']}: local {r['local_acc']:.4f} global {r['global_acc']:.4f} "
                    f"train {r['train_s_per_device']:.3f} s",
                    flush=True,
                )
        report["federation"] = runs
    report["machine"]["load_avg_end"] = list(os.getloadavg())
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
