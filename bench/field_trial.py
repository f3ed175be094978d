"""A field trial on one machine, through the commands a user types (issue 41): own image folders, own model.

Three devices hold image folders of 3, 4 and 6 of the 10 Fashion-MNIST classes (JPEGs under folders named after the
classes, drawn from the training split, disjoint), the server a labelled folder of all 10 classes (its public set and
its validation data), and a held-out folder of all 10 classes (the test split) is what the federation's exported
model must label. The model is the user's own: a factory in a module of their own (`trial_models.py`, written into
the trial folder and put on PYTHONPATH for every process, as a user's package would be installed). Per preset:

    protofl-server start --preset P --set archs=trial_models:make --public-data imagefolder:server,classes=FILE
        [--validation imagefolder:server,classes=FILE] --min-clients 3 --rounds R --state-dir server ...
    protofl-edge join --data imagefolder:dev-K,classes=FILE --arch trial_models:make --state-dir dev-K ...  (x3)
    protofl-export onnx --from server/artifacts/global --out P.onnx
    protofl-edge predict --model P.onnx --input heldout/ --out P.csv

and the labels are scored against the held-out folders' names (the classes file's order is the federation's class
ids). protofl's global export is its ridge predictor; FedAvg's is its global model. Writes DIR/field_trial.json and
prints a table.

    python -m bench.field_trial --out runs/field-trial [--per-class 150] [--rounds 8] [--presets protofl,fedavg]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from protofl.data import load_dataset
from protofl.data.classnames import FASHION_MNIST_CLASSES

DEVICE_CLASSES = ((0, 1, 9), (2, 3, 4, 5), (3, 5, 6, 7, 8, 9))  # 3, 4 and 6 of the 10 classes
MODELS = '''"""The trial's own model: a small CNN backbone (the factory takes (c, h, w) and returns an nn.Module)."""
from torch import nn


def make(in_shape):
    c = in_shape[0]
    return nn.Sequential(
        nn.Conv2d(c, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AvgPool2d((in_shape[1] // 4, in_shape[2] // 4)),
    )
'''


def write_folders(out: Path, per_class: int, server_per_class: int, heldout_per_class: int, seed: int) -> Path:
    """The trial's folders (and the classes file, returned)."""
    from PIL import Image

    train, test = load_dataset("fashion-mnist")
    rng = np.random.default_rng(seed)
    names = [n.replace("/", "-").replace(" ", "-").lower() for n in FASHION_MNIST_CLASSES]
    classes = out / "classes.txt"
    classes.write_text("".join(f"{n}\n" for n in names))
    pools = {c: list(rng.permutation(np.flatnonzero(train.y == c))) for c in range(10)}

    def save(folder: Path, x: np.ndarray, y: np.ndarray, tag: str) -> None:
        for i, (img, c) in enumerate(zip(x, y, strict=True)):
            d = folder / names[int(c)]
            d.mkdir(parents=True, exist_ok=True)
            Image.fromarray(img[0]).save(d / f"{tag}{i:05d}.jpg", quality=92)

    def take(c: int, n: int) -> np.ndarray:
        got, pools[c] = pools[c][:n], pools[c][n:]
        return np.asarray(got, np.int64)

    for k, held in enumerate(DEVICE_CLASSES):
        idx = np.concatenate([take(c, per_class) for c in held])
        save(out / f"dev-{k}", train.x[idx], train.y[idx], "d")
    idx = np.concatenate([take(c, server_per_class) for c in range(10)])
    save(out / "server", train.x[idx], train.y[idx], "s")
    hidx = np.concatenate([rng.permutation(np.flatnonzero(test.y == c))[:heldout_per_class] for c in range(10)])
    save(out / "heldout", test.x[hidx], test.y[hidx], "h")
    (out / "models").mkdir(exist_ok=True)
    (out / "models" / "trial_models.py").write_text(MODELS)
    return classes


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_preset(out: Path, preset: str, classes: Path, rounds: int, threads: int, timeout: float) -> dict[str, Any]:
    """One trial of `preset`: start + 3 joins, then export the global model and label the held-out folder."""
    where = out / preset
    where.mkdir(parents=True, exist_ok=True)
    path = [str(out / "models"), os.environ.get("PYTHONPATH")]  # the user's own model, installed
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, path)))
    env["OMP_NUM_THREADS"] = str(threads)
    port = free_port()
    cls = f",classes={classes}"
    server_argv = [
        "protofl-server", "start", "--preset", preset, "--set", "archs=trial_models:make", "--set", "num_classes=10",
        "--set", "in_shape=1,28,28", "--public-data", f"imagefolder:{out / 'server'}{cls}", "--min-clients", "3",
        "--rounds", str(rounds), "--round-timeout", str(int(timeout)), "--insecure", "--port", str(port),
        "--state-dir", str(where / "server"), "--fed", "trial",
    ]  # fmt: skip
    if preset == "protofl":  # the server scores its predictor on its own labelled folder (its held-out fifth)
        server_argv += ["--validation", f"imagefolder:{out / 'server'}{cls}"]
    t0 = time.time()
    server = subprocess.Popen(server_argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    joins = [
        subprocess.Popen(
            [
                "protofl-edge",
                "join",
                "--broker",
                f"mqtt://127.0.0.1:{port}",
                "--fed",
                "trial",
                "--client-id",
                f"dev-{k}",
                "--data",
                f"imagefolder:{out / f'dev-{k}'}{cls}",
                "--arch",
                "trial_models:make",
                "--threads",
                str(threads),
                "--connect-timeout",
                str(int(timeout)),
                "--state-dir",
                str(where / f"dev-{k}"),
            ],  # fmt: skip
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for k in range(len(DEVICE_CLASSES))
    ]
    try:
        slog, _ = server.communicate(timeout=timeout * (rounds + 2))
        jlogs = [j.communicate(timeout=120)[0] for j in joins]
    finally:
        for p in (server, *joins):
            if p.poll() is None:
                p.kill()
    wall = time.time() - t0
    if server.returncode != 0 or any(j.returncode != 0 for j in joins):
        raise SystemExit(f"{preset}: the trial failed:\n{slog[-3000:]}\n" + "\n".join(j[-1500:] for j in jlogs))
    model = where / f"{preset}.onnx"
    done = subprocess.run(
        [
            "protofl-export",
            "onnx",
            "--from",
            str(where / "server" / "artifacts" / "global"),
            "--out",
            str(model),
            "--exporter",
            "torchscript",
        ],  # fmt: skip
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"{preset}: export failed: {done.stdout}{done.stderr}")
    exported = done.stdout.strip().splitlines()
    labels = where / f"{preset}.csv"
    done = subprocess.run(
        [
            "protofl-edge",
            "predict",
            "--model",
            str(model),
            "--input",
            str(out / "heldout"),
            "--out",
            str(labels),
            "--show",
            "0",
        ],  # fmt: skip
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"{preset}: predict failed: {done.stdout}{done.stderr}")
    order = classes.read_text().split()
    with labels.open() as fh:
        rows = list(csv.DictReader(fh))
    truth = [order.index(Path(r["sample"]).parts[0]) for r in rows]
    pred = [int(r["class"]) for r in rows]
    rounds_log = [json.loads(line) for line in (where / "server" / "rounds.jsonl").read_text().splitlines()]
    per_class = {
        order[c]: float(np.mean([p == c for p, t in zip(pred, truth, strict=True) if t == c])) for c in range(10)
    }
    return {
        "preset": preset,
        "heldout_images": len(rows),
        "heldout_acc": float(np.mean(np.asarray(pred) == np.asarray(truth))),
        "heldout_acc_per_class": per_class,
        "uplink_bytes": int(sum(r["uplink_bytes"] for r in rounds_log)),
        "downlink_bytes": int(sum(r["downlink_bytes"] for r in rounds_log)),
        "local_acc_last_round": rounds_log[-1].get("local_acc"),
        "predictor_acc_server": rounds_log[-1].get("predictor_acc"),
        "exported": exported,
        "wall_s": wall,
        "server_argv": server_argv,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/field-trial"))
    p.add_argument("--per-class", type=int, default=150, help="images a device holds of each of its classes")
    p.add_argument("--server-per-class", type=int, default=40, help="the server's labelled images a class")
    p.add_argument("--heldout-per-class", type=int, default=100, help="held-out images a class (test split)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--presets", default="protofl,fedavg")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout", type=float, default=300.0, help="round timeout (s); the trial waits rounds+2 of them")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    classes = write_folders(a.out, a.per_class, a.server_per_class, a.heldout_per_class, a.seed)
    results = [run_preset(a.out, pr, classes, a.rounds, a.threads, a.timeout) for pr in a.presets.split(",")]
    report = {"args": {k: str(v) for k, v in vars(a).items()}, "device_classes": DEVICE_CLASSES, "results": results}
    (a.out / "field_trial.json").write_text(json.dumps(report, indent=1))
    print("| preset | global export on the held-out folder (10 classes) | uplink | server's predictor_acc |")
    print("|---|--:|--:|--:|")
    for r in results:
        srv = r["predictor_acc_server"]
        print(
            f"| {r['preset']} | {100 * r['heldout_acc']:.2f} % of {r['heldout_images']} | "
            f"{r['uplink_bytes'] / 1e6:.2f} MB | {'-' if srv is None else f'{100 * srv:.2f} %'} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
