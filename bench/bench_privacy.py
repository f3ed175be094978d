"""What privacy costs (issue 46): secure aggregation's bytes and device CPU per round, the server's unmasking time,
and accuracy against epsilon with local and distributed differential privacy.

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

`accuracy` runs `simulate` (the in-process transport, the cnn, `--clip off` everywhere) on the data side of
settings A and B (bench/table_runs.py: 10 clients at Dirichlet alpha 0.5, 20 at 0.1) at a reduced sizing (by
default 3 rounds, 1,500 training images, 500 test images: `--rounds`, `--train-limit`, `--test-limit`), for
tinyproto, fedproto and the protofl preset without its ridge predictor (DP covers prototype uploads only), at
epsilon in {1, 4, 8} and delta 1e-5 over the run with local DP, and for tinyproto and fedproto with distributed DP
under secure aggregation too (`--set secagg=true --set dp_mode=distributed`; secure aggregation refuses protofl),
each seed (`--seeds`, 0-2) beside its run without DP. Setting by setting, seed by seed; each report is kept in
bench/results/privacy/ as it finishes (a file that exists is not run again), with the run's wall time and the
machine's load (`bench`).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.paired import paired
from bench.table_runs import FEDERATIONS
from protofl import secagg, wire
from protofl.secagg import Device, FixedPoint, Server

RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class Size:
    """A run's sizing (the small setting by default: it runs on a loaded 2-core machine)."""

    rounds: int = 3
    train: int = 1500
    test: int = 500


ROOT = RESULTS / "privacy"
EPSILONS = (1.0, 4.0, 8.0, None)  # None: no DP
SEEDS = (0, 1, 2)
PRESETS = {"tinyproto": [], "fedproto": [], "protofl": ["--set", "ridge=false"]}
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
    """One device's messages in the wired protocol (broker_server/core/secagg_run.py and
    edge_agent/core/secagg_device.py
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
# The data side of settings A and B (bench/table_runs.py's FEDERATIONS "A05" and "B": clients and Dirichlet alpha).
SETTINGS = {"A": FEDERATIONS["A05"], "B": FEDERATIONS["B"]}
# "local": each device adds all of the noise; "distributed": under secure aggregation each adds 1/n of the variance,
# for the presets secure aggregation accepts (protofl.privacy.check_secagg refuses protofl's other uploads).
DISTRIBUTED = {"tinyproto", "fedproto"}
SECAGG = ["--set", "secagg=true", "--set", "dp_mode=distributed"]


def report_path(setting: str, preset: str, mode: str, eps: float | None, seed: int) -> Path:
    """One run's report; the run without DP is shared by both modes (secure aggregation without noise folds the same
    sum: tests/broker_server/test_secagg_*.py)."""
    tag = "nodp" if eps is None else f"{mode}-eps{eps:g}"
    return ROOT / f"{setting}-{preset}-{tag}-s{seed}.json"


Cell = tuple[str, str, str, float | None, int]  # setting, preset, mode, epsilon (None: no DP), seed


def grid(settings: list[str], presets: list[str], seeds: list[int], modes: list[str]) -> list[Cell]:
    """Every (setting, preset, mode, epsilon, seed) to run: setting by setting, seed by seed (a cut grid still has
    whole seeds of the first setting)."""
    out: list[Cell] = []
    for setting in settings:
        for seed in seeds:
            for preset in presets:
                out.append((setting, preset, "local", None, seed))
                for mode in modes:
                    if mode == "distributed" and preset not in DISTRIBUTED:
                        continue
                    out += [(setting, preset, mode, eps, seed) for eps in EPSILONS if eps is not None]
    return out


def command(
    setting: str,
    preset: str,
    mode: str,
    eps: float | None,
    seed: int,
    size: Size,
    data_dir: str,
    device: str,
    path: Path,
) -> list[str]:
    """The `simulate` command line of one run (clipping off everywhere: the server's upload clipping would shrink
    the noisy uploads of local DP, and secure aggregation refuses it; every row pairs with the same run)."""
    fed = SETTINGS[setting]
    cmd = [
        sys.executable, "-m", "broker_server.cli", "simulate", "--preset", preset,
        "--dataset", "fashion-mnist", "--data-dir", data_dir, "--clients", str(fed.clients),
        "--alpha", f"{fed.alpha:g}", "--clip", "off",
        "--rounds", str(size.rounds), "--seed", str(seed), "--arch", fed.archs[0],
        "--train-limit", str(size.train), "--test-limit", str(size.test),
        "--eval-every", str(size.rounds), "--test-every", str(size.rounds), "--transport", "inprocess",
        "--device", device, "-q", "--json", str(path), *PRESETS[preset],
    ]  # fmt: skip
    if eps is not None:
        cmd += ["--set", f"dp_epsilon={eps:g}"] + (SECAGG if mode == "distributed" else [])
    return cmd


def run_accuracy(
    data_dir: str, device: str, jobs: int, settings: list[str], presets: list[str], seeds: list[int],
    modes: list[str], size: Size,
) -> None:  # fmt: skip
    from concurrent.futures import ThreadPoolExecutor

    ROOT.mkdir(parents=True, exist_ok=True)
    todo = []
    for setting, preset, mode, eps, seed in grid(settings, presets, seeds, modes):
        path = report_path(setting, preset, mode, eps, seed)
        if not path.exists():
            todo.append((path, command(setting, preset, mode, eps, seed, size, data_dir, device, path)))

    def one(item: tuple[Path, list[str]]) -> None:
        path, cmd = item
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(f"failed: {' '.join(cmd)}\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}\n")
            return
        run = json.loads(path.read_text())
        run["bench"] = {"wall_s": time.perf_counter() - t0, **machine(), "size": asdict(size)}
        path.write_text(json.dumps(run))
        print(f"{path.name}: {time.perf_counter() - t0:.0f} s, load {run['bench']['load_1m']}", flush=True)

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


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def _cell(runs: dict[int, dict[str, Any]], key: str) -> str:
    """Mean ± standard deviation over the seeds, in percent ('-' where no run has the metric)."""
    vals = [v for r in runs.values() if (v := _final(r, key)) is not None]
    if not vals:
        return "-"
    if len(vals) == 1:
        return f"{100 * vals[0]:.1f}"
    return f"{100 * statistics.mean(vals):.1f} ± {100 * statistics.stdev(vals):.1f}"


def _paired(runs: dict[int, dict[str, Any]], base: dict[int, dict[str, Any]], key: str) -> str:
    """The paired difference (points) against the run without DP of the same seed, its 95 % interval and signs."""
    a = {s: 100 * v for s, r in runs.items() if (v := _final(r, key)) is not None}
    b = {s: 100 * v for s, r in base.items() if (v := _final(r, key)) is not None}
    p = paired(a, b)
    return p.text(1) if p.diffs else "-"


def accuracy_table() -> list[str]:
    """One row per (setting, preset, mode, epsilon): means over the seeds run, and the paired differences."""
    lines = [
        "| setting | preset | mode | epsilon | z | noise std: sum (per device) | local % | global % | global proto % | "
        "global - no DP (95 %) | global proto - no DP (95 %) | seeds |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for setting, fed in SETTINGS.items():
        for preset in PRESETS:
            base = {s: r for s in SEEDS if (r := _load(report_path(setting, preset, "local", None, s)))}
            rows: list[tuple[str, float | None]] = [("-", None)]
            rows += [(m, e) for m in ("local", "distributed") for e in EPSILONS if e is not None]
            for mode, eps in rows:
                runs = {s: r for s in SEEDS if (r := _load(report_path(setting, preset, mode, eps, s)))}
                if not runs:
                    continue
                dp = next(iter(runs.values())).get("privacy") or {}
                z = f"{dp['noise_multiplier']:.2f}" if dp else "-"
                std = "-"
                if dp:
                    each = dp["noise_std"] / math.sqrt(fed.clients) if mode == "distributed" else dp["noise_std"]
                    std = f"{dp['noise_std']:.1f} ({each:.2f})"
                diff = "-" if eps is None else _paired(runs, base, "global_acc")
                pdiff = "-" if eps is None else _paired(runs, base, "global_proto_acc")
                lines.append(
                    f"| {setting} | {preset} | {mode} | {'inf (no DP)' if eps is None else f'{eps:g}'} | {z} | "
                    f"{std} | {_cell(runs, 'local_acc')} | {_cell(runs, 'global_acc')} | "
                    f"{_cell(runs, 'global_proto_acc')} | {diff} | {pdiff} | {','.join(map(str, sorted(runs)))} |"
                )
    return lines


def sizing_line() -> str:
    """What the accuracy runs were: the sizing and the machine's load, from the reports themselves."""
    runs = [json.loads(p.read_text()) for p in sorted(ROOT.glob("[AB]-*.json"))]
    benched = [r["bench"] for r in runs if "bench" in r]
    if not benched:
        return ""
    size = benched[0]["size"]
    loads = [b["load_1m"] for b in benched]
    walls = [b["wall_s"] for b in benched]
    return (
        f"Sizing (not the papers'): {size['rounds']} rounds, {size['train']:,} training images (seeded subset), "
        f"{size['test']:,} test images, the cnn, settings' clients and alpha as bench/table_runs.py (A: "
        f"{SETTINGS['A'].describe}; B: {SETTINGS['B'].describe}), `--clip off` on every row. {len(runs)} runs, "
        f"{min(walls):.0f}-{max(walls):.0f} s each (median {statistics.median(walls):.0f} s), load average "
        f"{min(loads):.1f}-{max(loads):.1f} at their ends on {benched[0]['cpus']} cores."
    )


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
        lines += [
            "### Accuracy against epsilon (delta 1e-5 over the run; `python -m bench.bench_privacy accuracy`)",
            "",
            sizing_line(),
            "",
            "Means ± standard deviation over the seeds; the differences are paired by seed against the same "
            "setting and preset without DP (points, mean [95 % Student-t interval] (signs per seed), bench/paired.py). "
            "Noise std: what the server's sum of a class carries (z * 2 C sqrt(R)) and, in brackets, what one device "
            "adds (all of it with local DP; 1/sqrt(n) of it with distributed DP, n the setting's clients).",
            "",
            *acc,
            "",
        ]
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
    ap.add_argument("--settings", default=",".join(SETTINGS), help="accuracy: which settings (A, B)")
    ap.add_argument("--presets", default=",".join(PRESETS), help="accuracy: which presets")
    ap.add_argument("--modes", default="local,distributed", help="accuracy: local and/or distributed DP")
    ap.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="accuracy: which seeds")
    ap.add_argument("--rounds", type=int, default=Size.rounds)
    ap.add_argument("--train-limit", type=int, default=Size.train)
    ap.add_argument("--test-limit", type=int, default=Size.test)
    args = ap.parse_args(argv)
    if args.what == "secagg":
        print(json.dumps(run_secagg(), indent=1))
    elif args.what == "accuracy":
        seeds = [int(x) for x in args.seeds.split(",")]
        size = Size(args.rounds, args.train_limit, args.test_limit)
        run_accuracy(
            args.data_dir, args.device, args.jobs, args.settings.split(","), args.presets.split(","), seeds,
            args.modes.split(","), size,
        )  # fmt: skip
    write_table()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
