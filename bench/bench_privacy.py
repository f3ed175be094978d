"""What privacy costs (issue 46): secure aggregation's bytes and device CPU per round, the server's unmasking time,
and accuracy against epsilon with local differential privacy.

    python -m bench.bench_privacy secagg                      # bytes, device CPU, unmask at 1,000 and 10,000
    python -m bench.bench_privacy accuracy --data-dir /usr/share/datasets/fashion-mnist [--device cuda]
    python -m bench.bench_privacy table                       # bench/results/PRIVACY.md from what was run

`secagg` runs protofl/secagg.py's devices and server in one process (the protocol is pure: no broker), for a
tinyproto upload's table vector (10 classes x (51 values + a weight)): the bytes each step adds per device, as
payload (the keys, the encrypted shares, the masked vector as u4, the unmasking answers: the step's real byte
strings) and as wired (each step's wire message encoded, envelope included: the MQTT payload), against the
tinyproto upload's encoded message (`message_size`, envelope included); a device's CPU for one round (process
time; rpi4's is this machine's over its profile's compute factor); the server's unmask time at 100, 1,000 and
10,000 devices with 10 % dropped after sharing their keys (the costly case: each dropped device's mask key is
rebuilt and its pairwise masks recomputed).

`accuracy` runs `simulate` (the in-process transport; by default a small setting: 10 clients, alpha 0.5, 5 rounds,
3,000 training images, 2,000 test images; `--rounds`, `--train-limit`... for setting A's sizing) at epsilon in
{1, 4, 8, inf} and delta 1e-5 over the run, seeds 0-2 (`--seeds`), for tinyproto and the protofl preset without its
ridge predictor (DP covers prototype uploads only; `--presets`); each report is kept in bench/results/privacy/ (a
file that exists is not run again).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from protofl import secagg, wire
from protofl.secagg import Device, FixedPoint, Server

RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class Size:
    """A run's sizing (the small setting by default: it runs on a loaded 2-core machine)."""

    clients: int = 10
    rounds: int = 5
    train: int = 3000
    test: int = 2000


ROOT = RESULTS / "privacy"
EPSILONS = (1.0, 4.0, 8.0, None)  # None: no DP
SEEDS = (0, 1, 2)
PRESETS = {"tinyproto": [], "protofl": ["--set", "ridge=false"]}
WIDTH = 10 * 51  # a tinyproto upload: 10 classes x s = 51 values
TABLE = 10 * (51 + 1)  # what a tinyproto device masks: per class its 51 values and its weight
ID_BYTES = 16  # what naming a device costs in a message (an id of 16 characters: the roster names each)


# -- secure aggregation ----------------------------------------------------------------------------------------
def one_phase(n: int, dropped: float, width: int, rng: np.random.Generator) -> dict[str, Any]:
    """One phase at n devices, a fraction dropped after sharing keys: bytes and times per step."""
    ctx = secagg.context("bench", 1, "train")
    ring = FixedPoint.for_sum(1.0, n)
    ids = [f"device-{i:09d}" for i in range(n)]
    server = Server(ctx, seed=b"bench")
    t0 = time.process_time()
    devices = {i: Device(i, ctx) for i in ids}
    keys = {i: d.advertise() for i, d in devices.items()}
    t_adv = time.process_time() - t0
    for i, k in keys.items():
        server.advertised(i, k)
    keys_for = server.close_advertise()
    t = server.threshold()
    t0 = time.process_time()
    sent = {i: devices[i].share_keys(keys_for[i], t) for i in ids}
    t_share = time.process_time() - t0
    routed = server.route_shares(sent)
    t0 = time.process_time()
    for v, boxes in routed.items():
        devices[v].receive_shares(boxes)
    t_recv = time.process_time() - t0
    drop = set(rng.choice(ids, size=int(round(dropped * n)), replace=False).tolist())
    x = {i: rng.uniform(-1, 1, width) for i in ids if i not in drop}
    t0 = time.process_time()
    for i in sorted(x):
        server.received(i, devices[i].masked_input(ring.encode(x[i]), server.shared))
    t_mask = time.process_time() - t0
    survivors = set(server.masked)
    t0 = time.process_time()
    answers = {i: devices[i].unmask(survivors) for i in sorted(survivors)}
    t_answer = time.process_time() - t0
    t0 = time.perf_counter()
    total = server.unmask(answers)
    t_unmask = time.perf_counter() - t0
    plain = np.sum(list(x.values()), axis=0)
    err = float(np.abs(ring.decode(total) - plain).max())
    assert err <= len(x) * ring.resolution, err
    degree = max(len(v) for v in server.graph.values())
    one = ids[0] if ids[0] not in drop else sorted(survivors)[0]
    order = sorted(keys_for[one])  # its roster: every list after it follows this order, by position
    up = {
        "advertise": 2 * 32,
        "shares": sum(len(b) for b in sent[one].values()),
        "masked": 4 * width,
        "unmask": secagg.SHARE_BYTES * len(answers[one]),
    }
    down = {
        "keys": sum(ID_BYTES + 64 for _ in keys_for[one]),
        "shares": sum(len(b) for b in routed[one].values()) + math.ceil(len(order) / 8),
    }
    per = len(ids)
    wire_up, wire_down = wire_bytes(one, keys[one], sent[one], answers[one], keys_for[one], routed[one], width)
    alive = [i for i, v in enumerate(order) if v in survivors]
    wire_down["survivors"] = message_bytes(wire.SaSurvivors(alive), "server")
    return {
        "devices": n,
        "dropped": len(drop),
        "k": degree,
        "threshold": t,
        "frac_bits": ring.frac_bits,
        "max_error": err,
        "up_bytes": up,
        "down_bytes": down,
        "wire_up_bytes": wire_up,
        "wire_down_bytes": wire_down,
        "device_cpu_s": (t_adv + t_share + t_recv) / per + t_mask / len(x) + t_answer / len(survivors),
        "server_unmask_s": t_unmask,
    }


def message_bytes(msg: Any, sender: str) -> int:
    """The bytes of one wire message as the wired protocol sends it (envelope included: the MQTT payload)."""
    return len(wire.encode_message(msg, fed="bench", sender=sender, round=1, phase="train"))


def wire_bytes(
    me: str,
    keys: secagg.Keys,
    sent: dict[str, bytes],
    answers: dict[str, tuple[str, int]],
    keys_for: dict[str, secagg.Keys],
    routed: dict[str, bytes],
    width: int,
) -> tuple[dict[str, int], dict[str, int]]:
    """One device's messages in the wired protocol (broker_server/secagg_run.py and edge_agent/secagg_device.py
    build the same), as encoded on the wire: its four uploads and the server's roster and routed shares to it (the
    survivors list is added by the caller)."""
    order = sorted(keys_for)
    senders = [i for i, v in enumerate(order) if v in routed]
    up = {
        "advertise": message_bytes(wire.SaKeys(keys.c, keys.s), me),
        "shares": message_bytes(wire.SaShares([sent[v] for v in order]), me),
        "masked": message_bytes(wire.SaMasked(np.zeros(width, dtype=np.uint32)), me),
        "unmask": message_bytes(
            wire.SaUnmask([y.to_bytes(secagg.SHARE_BYTES, "big") for _, y in answers.values()]), me
        ),
    }
    roster = wire.SaRoster({v: (k.c, k.s) for v, k in keys_for.items()}, t=1, frac_bits=10, bound=1e4, weighted=False)
    down = {
        "keys": message_bytes(roster, "server"),
        "shares": message_bytes(wire.SaRouted(senders, [routed[order[i]] for i in senders]), "server"),
    }
    return up, down


def tinyproto_upload_bytes() -> int:
    """The encoded training upload of a tinyproto device with 10 classes (f4, no counts), envelope included."""
    from protofl.wire import ProtoSet, ProtoUpload, message_size

    table = {c: np.ones(51, dtype=np.float32) for c in range(10)}
    up = ProtoUpload(local=ProtoSet.from_table(table, 51, "f4", None), public=None, n_samples=600)
    return message_size(up, fed="bench", sender="device-000000001", round=1, phase="train")


def run_secagg() -> dict[str, Any]:
    from protofl.profiles import load_device

    rng = np.random.default_rng(0)
    rpi4 = load_device("rpi4").compute_factor
    tiny = tinyproto_upload_bytes()
    # the envelope and framing of one message: the tinyproto upload's bytes beyond its values
    out: dict[str, Any] = {
        "tinyproto_upload_bytes": tiny,
        "envelope_bytes": tiny - 4 * WIDTH,
        "rpi4_compute_factor": rpi4,
    }
    out["at_100"] = one_phase(100, 0.1, TABLE, rng)
    out["at_1000"] = one_phase(1000, 0.1, TABLE, rng)
    out["at_10000"] = one_phase(10_000, 0.1, TABLE, rng)
    out["machine"] = machine()
    ROOT.mkdir(parents=True, exist_ok=True)
    (ROOT / "secagg.json").write_text(json.dumps(out, indent=1))
    return out


# -- accuracy against epsilon ---------------------------------------------------------------------------------
def report_path(preset: str, eps: float | None, seed: int) -> Path:
    return ROOT / f"{preset}-eps{'inf' if eps is None else f'{eps:g}'}-s{seed}.json"


def run_accuracy(data_dir: str, device: str, jobs: int, presets: list[str], seeds: list[int], size: Size) -> None:
    from concurrent.futures import ThreadPoolExecutor

    ROOT.mkdir(parents=True, exist_ok=True)
    todo: list[tuple[Path, list[str]]] = []
    for preset in presets:
        extra = PRESETS[preset]
        for seed in seeds:
            for eps in EPSILONS:
                path = report_path(preset, eps, seed)
                if path.exists():
                    continue
                cmd = [
                    sys.executable, "-m", "broker_server.cli", "simulate", "--preset", preset,
                    "--dataset", "fashion-mnist", "--data-dir", data_dir, "--clients", str(size.clients),
                    "--alpha", "0.5",
                    "--rounds", str(size.rounds), "--seed", str(seed), "--arch", "cnn",
                    "--train-limit", str(size.train), "--test-limit", str(size.test),
                    "--eval-every", str(size.rounds), "--test-every", str(size.rounds), "--transport", "inprocess",
                    "--device", device, "-q", "--json", str(path), *extra,
                ]  # fmt: skip
                if eps is not None:
                    cmd += ["--set", f"dp_epsilon={eps:g}"]
                todo.append((path, cmd))

    def one(item: tuple[Path, list[str]]) -> None:
        path, cmd = item
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(f"failed: {' '.join(cmd)}\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}\n")
            return
        print(f"{path.name}: {time.perf_counter() - t0:.0f} s", flush=True)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(one, todo))


# -- the table --------------------------------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    import os

    load = os.getloadavg()
    return {"cpus": os.cpu_count(), "load_1m": round(load[0], 2), "numpy": np.__version__}


def _final(run: dict[str, Any], key: str) -> float | None:
    value = run["rounds"][-1].get(key) if run["rounds"] else None
    return None if value is None else float(value)


def accuracy_table() -> list[str]:
    lines = [
        "| preset | epsilon | noise multiplier z | noise std per value | local % | global % | global proto % | "
        "global - no DP (paired, 95 %) | seeds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for preset in PRESETS:
        base = {s: json.loads(p.read_text()) for s in SEEDS if (p := report_path(preset, None, s)).exists()}
        for eps in EPSILONS:
            runs = {s: json.loads(p.read_text()) for s in SEEDS if (p := report_path(preset, eps, s)).exists()}
            if not runs:
                continue

            def cell(key: str, runs: dict[int, Any] = runs) -> str:
                vals = [v for r in runs.values() if (v := _final(r, key)) is not None]
                if not vals:
                    return "-"
                if len(vals) == 1:
                    return f"{100 * vals[0]:.1f}"
                return f"{100 * statistics.mean(vals):.1f} ± {100 * statistics.stdev(vals):.1f}"

            diffs = [
                100 * (a - b)
                for s in runs
                if s in base and (a := _final(runs[s], "global_acc")) is not None
                and (b := _final(base[s], "global_acc")) is not None
            ]  # fmt: skip
            paired = "-"
            if eps is not None and len(diffs) >= 2:
                t975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776}[len(diffs) - 1]
                half = t975 * statistics.stdev(diffs) / math.sqrt(len(diffs))
                m = statistics.mean(diffs)
                signs = "".join("+" if d > 0 else "-" for d in diffs)
                paired = f"{m:+.1f} [{m - half:+.1f}, {m + half:+.1f}] ({signs})"
            dp = next(iter(runs.values())).get("privacy") or {}
            z = f"{dp['noise_multiplier']:.2f}" if dp else "-"
            std = f"{dp['noise_std']:.1f}" if dp else "-"
            lines.append(
                f"| {preset} | {'inf (no DP)' if eps is None else f'{eps:g}'} | {z} | {std} | {cell('local_acc')} | "
                f"{cell('global_acc')} | {cell('global_proto_acc')} | {paired} | {len(runs)} |"
            )
    return lines


def write_table() -> None:
    sec = json.loads((ROOT / "secagg.json").read_text()) if (ROOT / "secagg.json").exists() else None
    head = (
        (RESULTS / "PRIVACY.md").read_text().split("<!-- generated -->")[0] if (RESULTS / "PRIVACY.md").exists() else ""
    )
    lines = [head.rstrip(), "", "<!-- generated -->", ""]
    if sec is not None:
        tiny = sec["tinyproto_upload_bytes"]
        lines += [
            "### Secure aggregation per device and round (`python -m bench.bench_privacy secagg`)",
            "",
            f"Machine: {sec['machine']['cpus']} cores, load average {sec['machine']['load_1m']} when it ended, numpy "
            f"{sec['machine']['numpy']}. A tinyproto upload (10 classes x 51 values, f4) is {tiny:,} B encoded.",
            "",
            "Up: the four messages a device sends a round; payload is their byte strings (keys, encrypted shares, the "
            "masked table vector as u4, the unmasking shares), as wired is each message encoded with its envelope "
            "(the MQTT payload). Down: the server's roster, routed shares and survivors list to that device, as wired.",
            "",
            "| devices | k | t | up payload: keys + shares + masked + unmask | as wired: keys + shares + masked + "
            "unmask | as wired / tinyproto upload | down as wired: roster + routed + survivors | "
            "device CPU (this machine) | device CPU on rpi4 | server unmask (10 % dropped) | max error |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for key in ("at_100", "at_1000", "at_10000"):
            r = sec[key]
            up, wup, wdown = r["up_bytes"], r["wire_up_bytes"], r["wire_down_bytes"]
            lines.append(
                f"| {r['devices']:,} | {r['k']} | {r['threshold']} | {_terms(up)} | {_terms(wup)} | "
                f"{sum(wup.values()) / tiny:.2f}x | {_terms(wdown)} | {1000 * r['device_cpu_s']:.1f} ms | "
                f"{1000 * r['device_cpu_s'] / sec['rpi4_compute_factor']:.0f} ms | {r['server_unmask_s']:.2f} s | "
                f"{r['max_error']:.1e} |"
            )
        lines.append("")
    acc = accuracy_table()
    if len(acc) > 2:
        lines += ["### Accuracy against epsilon (local DP, delta 1e-5 over the run)", "", *acc, ""]
    (RESULTS / "PRIVACY.md").write_text("\n".join(lines).lstrip() + "\n")


def _terms(parts: dict[str, int]) -> str:
    """'a + b + c = total B' of a step's bytes."""
    return " + ".join(f"{v:,}" for v in parts.values()) + f" = {sum(parts.values()):,} B"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_privacy", description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("secagg", "accuracy", "table"))
    ap.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--jobs", type=int, default=1, help="simulations run at once (accuracy)")
    ap.add_argument("--presets", default=",".join(PRESETS), help="accuracy: which presets")
    ap.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="accuracy: which seeds")
    ap.add_argument("--clients", type=int, default=Size.clients)
    ap.add_argument("--rounds", type=int, default=Size.rounds)
    ap.add_argument("--train-limit", type=int, default=Size.train)
    ap.add_argument("--test-limit", type=int, default=Size.test)
    args = ap.parse_args(argv)
    if args.what == "secagg":
        print(json.dumps(run_secagg(), indent=1))
    elif args.what == "accuracy":
        seeds = [int(x) for x in args.seeds.split(",")]
        size = Size(args.clients, args.rounds, args.train_limit, args.test_limit)
        run_accuracy(args.data_dir, args.device, args.jobs, args.presets.split(","), seeds, size)
    write_table()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
