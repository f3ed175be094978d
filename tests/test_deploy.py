"""From a finished federation to labels on a device (issue 25), through the command lines only.

A small federation (`simulate --out`, and `start` + `join --state-dir`) leaves its deployable artifacts;
`protofl-export` reads them alone (onnx, verify with the max difference, quantize), and `protofl-edge
predict` labels an unlabelled npz and an image folder in a process where torch cannot be imported. Its
labels are the torch model's nearest-prototype labels (>= 99 %, fp32). The global predictor's accuracy is
in the JSON report and the simulate table where the preset has one, and null with the reason where not.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from broker_server.cli import app as server_app
from broker_server.ops.broker import free_port
from export.cli import app as export_app
from protofl import artifacts as art
from protofl.data import load_dataset
from tests.pipelines import NO_FLOOR, as_cli_sets
from tests.test_packaging import run_without_torch

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(REPO))
DATA = "synthetic:n=600,n_test=100"
runner = CliRunner()


def edge_without_torch(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """`protofl-edge ...` in a process whose imports of torch fail, as on a device without it (and that
    never imported it when the command returns)."""
    return run_without_torch("protofl-edge", *map(str, args))


def unlabelled(tmp: Path) -> tuple[Path, Path, np.ndarray]:
    """An npz of images without labels, and the same images as a folder of PNGs (nested)."""
    from PIL import Image

    _, test = load_dataset(DATA)
    x = test.x[:40]
    tmp.mkdir(parents=True, exist_ok=True)
    npz = tmp / "new.npz"
    np.savez(npz, x=x)
    for i in range(len(x)):
        sub = tmp / "photos" / f"batch{i % 2}"
        sub.mkdir(parents=True, exist_ok=True)
        Image.fromarray(x[i, 0]).save(sub / f"{i:03d}.png")
    return npz, tmp / "photos", x


def torch_labels(loaded, what: str, x: np.ndarray) -> np.ndarray:
    """What the torch model says: nearest prototype (its table and metric), or a classifier's argmax."""
    from edge_agent.inference.predict import classify

    mean, std = loaded.norm
    c = x.shape[1]
    xn = (x.astype(np.float32) / 255 - np.float32(mean).reshape(1, c, 1, 1)) / np.float32(std).reshape(1, c, 1, 1)
    with torch.inference_mode():
        z = loaded.model.features(torch.from_numpy(xn))
        if what == "logits":
            return loaded.model.head(z).argmax(1).numpy()
    return classify(z.numpy(), loaded.prototypes, loaded.prototypes.metric or "l2").classes


def read_labels(path: Path) -> dict[str, int]:
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in path.read_text().splitlines()]
    else:
        with path.open() as fh:
            rows = list(csv.DictReader(fh))
    return {str(r["sample"]): int(r["class"]) for r in rows}


def export_and_label(artifact: Path, tmp: Path, what: str | None = None, **select: str) -> str:
    """onnx --from (the `what` graph, else the artifact's own), verify, quantize, then predict without torch on
    an npz and an image folder; returns what onnx and verify printed. Asserts the labels agree with torch's on
    >= 99 % of the images."""
    from export.artifact import load_artifact

    extra = [a for k, v in select.items() for a in (f"--{k}", v)]
    model = tmp / "deploy" / "model.onnx"
    graph = ["--what", what] if what else []
    r = runner.invoke(
        export_app, ["onnx", "--from", str(artifact), *extra, "--out", str(model), *graph, "--exporter", "torchscript"]
    )
    assert r.exit_code == 0, r.output
    exported = r.output
    r = runner.invoke(export_app, ["verify", str(model), "--from", str(artifact), *extra, "--n", "32"])
    assert r.exit_code == 0 and "PASS" in r.output and "max |onnx - torch| = " in r.output, r.output
    verified = exported + r.output
    r = runner.invoke(
        export_app,
        ["quantize", str(model), "--out", str(tmp / "int8" / "model.onnx"), "--train-n", "200", "--test-n", "100"],
    )
    assert r.exit_code == 0 and "int8 (dynamic)" in r.output, r.output
    # what the accuracy is (issue 41): this model, on the run's own data's test split
    assert "accuracy of model.onnx (" in r.output and " images of the test split of 'synthetic:" in r.output, r.output
    assert "(the data its run recorded; " in r.output, r.output
    npz, photos, x = unlabelled(tmp)
    loaded = load_artifact(artifact, **select)
    want = torch_labels(loaded, what or loaded.what, x)
    for source, out in ((f"npz:{npz}", tmp / "labels.csv"), (str(photos), tmp / "labels.jsonl")):
        done = edge_without_torch("predict", "--model", model, "--input", source, "--out", out, "--show", "0")
        assert done.returncode == 0, done.stdout + done.stderr
        got = read_labels(out)
        keys = (
            [str(i) for i in range(len(x))]
            if out.suffix == ".csv"
            else [f"batch{i % 2}/{i:03d}.png" for i in range(len(x))]
        )
        agree = np.mean([got[k] == int(w) for k, w in zip(keys, want, strict=True)])
        assert agree >= 0.99, f"{source}: {agree:.1%} of the labels agree with torch's"
    # the int8 model found its prototype table too (copied beside it)
    done = edge_without_torch("predict", "--model", tmp / "int8" / "model.onnx", "--input", f"npz:{npz}", "--show", "0")
    assert done.returncode == 0, done.stdout + done.stderr
    return verified


@pytest.fixture(scope="module")
def fedproto_run(tmp_path_factory: pytest.TempPathFactory, one_torch_thread: None) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("sim")
    r = runner.invoke(
        server_app,
        [
            "simulate",
            "--preset",
            "fedproto",
            "--dataset",
            DATA,
            "--clients",
            "3",
            "--rounds",
            "2",
            *as_cli_sets(NO_FLOOR),  # the step floor off (tests/pipelines.py NO_FLOOR): the artifacts are the point
            "--out",
            str(out / "run"),
            "--json",
            str(out / "run.json"),
        ],
    )
    assert r.exit_code == 0, r.output
    assert "predictor: only prototypes are federated" in r.output  # the table says why it has no predictor
    return out / "run", json.loads((out / "run.json").read_text())


@pytest.mark.slow
def test_simulate_leaves_what_a_device_deploys(fedproto_run: tuple[Path, dict], tmp_path: Path) -> None:
    run, report = fedproto_run
    assert sorted(p.name for p in (run / "devices").iterdir()) == ["client-000", "client-001", "client-002"]
    manifest = art.read_json(run / art.MANIFEST)
    assert manifest["round"] == 2 and manifest["finished"] and manifest["predictor"]["kind"] is None
    glob = art.read_prototypes(run / "global" / art.PROTOTYPES)
    assert glob.values.shape[1] == 512 and glob.metric == "l2"  # full width
    assert all(row["predictor_acc"] is None for row in report["rounds"])
    assert report["predictor"] == {"kind": None, "reason": manifest["predictor"]["reason"]}
    export_and_label(run, tmp_path, device="client-001")
    # the graph remembers the artifact it came from (and the run's data): verify needs nothing else
    r = runner.invoke(export_app, ["verify", str(tmp_path / "deploy" / "model.onnx"), "--n", "16"])
    assert r.exit_code == 0 and "PASS" in r.output, r.output


@pytest.mark.slow
def test_a_late_joiner_labels_with_the_global_state_before_it_trains(
    fedproto_run: tuple[Path, dict], tmp_path: Path
) -> None:
    from edge_agent.training.models import build_model

    run, _ = fedproto_run
    r = runner.invoke(
        export_app, ["onnx", "--from", str(run), "--out", str(tmp_path / "new.onnx"), "--exporter", "torchscript"]
    )
    assert r.exit_code == 0 and "a new device of federation 'sim'" in r.output, r.output
    from export.artifact import load_artifact

    loaded = load_artifact(run)  # the weights a device that joins now starts from, and the global prototypes
    cfg = art.read_json(run / art.MANIFEST)["config"]
    initial = build_model(cfg["archs"][0], tuple(cfg["in_shape"]), cfg["num_classes"], seed=cfg["seed"])
    assert loaded.prototypes is not None and loaded.prototypes.source == "global"
    assert torch.equal(loaded.model.head.weight, initial.head.weight)
    npz, _, _ = unlabelled(tmp_path)
    done = edge_without_torch("predict", "--model", tmp_path / "new.onnx", "--input", npz, "--show", "1")
    assert done.returncode == 0 and "labelled 40 samples" in done.stdout, done.stdout + done.stderr


@pytest.mark.slow
def test_the_global_predictor_is_reported_exported_and_labels(tmp_path: Path, one_torch_thread: None) -> None:
    # RefProtoFL's federated adapter and head on the frozen backbone every device shares.
    run, report = tmp_path / "run", tmp_path / "run.json"
    r = runner.invoke(
        server_app,
        [
            "simulate",
            "--preset",
            "refprotofl",
            "--set",
            "backbone=frozen",
            *as_cli_sets(NO_FLOOR),  # the step floor off: the predictor's path is the point
            "--dataset",
            DATA,
            "--clients",
            "3",
            "--rounds",
            "2",
            "--test-every",
            "1",
            "--out",
            str(run),
            "--json",
            str(report),
        ],
        env={"COLUMNS": "200"},
    )  # the table's columns unwrapped
    assert r.exit_code == 0, r.output
    rows = json.loads(report.read_text())["rounds"]
    assert all(isinstance(row["predictor_acc"], float) for row in rows)
    assert "predictor %" in r.output and f"{100 * rows[-1]['predictor_acc']:.2f}" in r.output
    assert json.loads(report.read_text())["predictor"]["kind"] == "adapter"
    # The run's global state: the global predictor as a classifier ...
    assert "cnn logits" in export_and_label(run, tmp_path / "logits", what="logits")
    # ... and, by default, the features of the same model (a new device's) with the global prototypes
    assert "the global adapter, global prototypes" in export_and_label(run, tmp_path / "features")


@pytest.mark.slow
def test_the_default_preset_s_ridge_predictor_exports_and_labels_as_the_simulation_scored_it(
    tmp_path: Path, one_torch_thread: None
) -> None:
    """The protofl preset's global predictor (issue 41): a ridge head on the shared backbone, scored by the
    simulation every round; its ONNX export labels the simulation's test set exactly as the simulation scored it
    (the same labels, bit for bit, as the torch model; the same count correct as the report's accuracy)."""
    from export.artifact import load_artifact

    run, report = tmp_path / "run", tmp_path / "run.json"
    argv = ["simulate", "--dataset", DATA, "--clients", "3", "--rounds", "2", "--test-every", "1"]
    r = runner.invoke(server_app, [*argv, "--out", str(run), "--json", str(report)], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    out = json.loads(report.read_text())
    assert out["config"]["preset"] == "protofl" and out["predictor"]["kind"] == "head", out["predictor"]
    accs = [row["predictor_acc"] for row in out["rounds"]]
    assert all(isinstance(a, float) for a in accs), accs
    manifest = art.read_json(run / art.MANIFEST)
    made = manifest["predictor"]["made_from"]
    assert made["kind"] == "ridge" and made["devices"] == 3 and made["backbone"] == "shipped", made
    assert len(made["norm_mean"]) == len(made["norm_std"]) == 1, made  # the backbone's inputs' normalisation
    model = tmp_path / "global.onnx"
    r = runner.invoke(
        export_app, ["onnx", "--from", str(run / "global"), "--out", str(model), "--exporter", "torchscript"]
    )
    assert r.exit_code == 0 and "cnn logits" in r.output and "ridge head from 3 device(s)" in r.output, r.output
    _, test = load_dataset(DATA)  # the simulation's test set, whole (no --test-limit)
    npz = tmp_path / "test.npz"
    np.savez(npz, x=test.x)
    labels = tmp_path / "labels.csv"
    done = edge_without_torch("predict", "--model", model, "--input", f"npz:{npz}", "--out", labels, "--show", "0")
    assert done.returncode == 0, done.stdout + done.stderr
    got = read_labels(labels)
    onnx_labels = np.array([got[str(i)] for i in range(len(test.y))])
    want = torch_labels(load_artifact(run / "global"), "logits", test.x)
    assert np.array_equal(onnx_labels, want), f"{int((onnx_labels != want).sum())} labels differ from torch's"
    assert int((onnx_labels == test.y).sum()) == round(accs[-1] * len(test.y)), (accs[-1], len(test.y))


def start_process(port: int, fed: str, state_dir: Path, *args: str, broker: str = "amqtt") -> subprocess.Popen[str]:
    """`protofl-server start ARGS` on its own broker (`broker`: the embedded amqtt, or Mosquitto) at `port`, insecure,
    keeping its state in `state_dir`."""
    argv = [sys.executable, "-m", "broker_server.cli", "start", "--local-broker", broker, "--insecure",
            "--port", str(port), "--fed", fed, *args, "--state-dir", str(state_dir)]  # fmt: skip
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV, text=True)


def join_process(port: int, fed: str, client_id: str, state_dir: Path, *args: str) -> subprocess.Popen[str]:
    """`protofl-edge join ARGS` to the broker at `port`, one torch thread, keeping its state in `state_dir`."""
    argv = [sys.executable, "-m", "edge_agent.cli", "join", "--broker", f"mqtt://127.0.0.1:{port}", "--fed", fed,
            "--client-id", client_id, *args, "--threads", "1", "--connect-timeout", "60",
            "--state-dir", str(state_dir)]  # fmt: skip
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV, text=True)


def trial(tmp: Path, *server_args: str, rounds: int = 2, broker: str = "amqtt") -> Path:
    """`start SERVER_ARGS` + two `join --state-dir` processes over the server's own broker: their state dirs."""
    port = free_port()
    server = start_process(
        port,
        "dep",
        tmp / "server",
        *server_args,
        *("--rounds", str(rounds), "--min-clients", "2", "--round-timeout", str(60 * rounds)),
        broker=broker,
    )
    devices = [
        join_process(port, "dep", f"dev-{i}", tmp / f"dev-{i}", "--data", DATA, "--partition", f"{i}/2")
        for i in range(2)
    ]
    try:
        out, _ = server.communicate(timeout=120 * rounds)
        dev_out = [d.communicate(timeout=60)[0] for d in devices]
    finally:
        for p in (server, *devices):
            if p.poll() is None:
                p.kill()
    assert server.returncode == 0, out
    assert all(d.returncode == 0 for d in devices), dev_out
    return tmp


@pytest.fixture(scope="module")
def started(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # the step floor off (tests/pipelines.py NO_FLOOR): what a device deploys is the point, not how long it trained
    return trial(tmp_path_factory.mktemp("start"), "--preset", "fedproto", *as_cli_sets(NO_FLOOR))


@pytest.fixture(scope="module")
def started_default(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default preset (its ridge predictor), its backbone trained on the public set of the server's data, scored
    every round on the server's validation data."""
    return trial(tmp_path_factory.mktemp("start-default"), "--public-data", DATA, "--validation", DATA)


@pytest.fixture(scope="module")
def started_route(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default preset with the ridge predictor's route opted in (`--set ridge_topk=0.001`; off by default,
    docs/algorithms.md "The route"), 3 rounds on Mosquitto."""
    tmp = tmp_path_factory.mktemp("start-route")
    # the step floor off (tests/pipelines.py NO_FLOOR): g bit for bit on every device is the point
    args = ("--public-data", DATA, "--validation", DATA, "--set", "ridge_topk=0.001", *as_cli_sets(NO_FLOOR))
    return trial(tmp, *args, rounds=3, broker="mosquitto")


@pytest.mark.slow
def test_start_and_join_leave_what_a_device_deploys(started: Path, tmp_path: Path, one_torch_thread: None) -> None:
    device = started / "dev-1" / "artifacts"  # join --state-dir DIR: DIR/artifacts/devices/dev-1
    info = art.read_json(device / "devices" / "dev-1" / art.DEVICE)
    assert info["rounds_trained"] == 2 and info["fed"] == "dep" and info["prototypes"]["source"] == "global"
    verified = export_and_label(device, tmp_path)  # its one device, found without --device
    assert "tolerance 0.0001" in verified


@pytest.mark.slow
def test_start_leaves_the_federation_s_global_state(started: Path) -> None:
    manifest = art.read_json(started / "server" / "artifacts" / art.MANIFEST)
    assert manifest["fed"] == "dep" and manifest["round"] == 2 and manifest["finished"]
    glob = art.read_prototypes(started / "server" / "artifacts" / "global" / art.PROTOTYPES)
    assert glob.values.shape == (len(glob.classes), 512) and glob.source == "global"


@pytest.mark.slow
def test_start_scores_the_predictor_and_every_device_keeps_it(
    started_default: Path, tmp_path: Path, one_torch_thread: None
) -> None:
    """The default preset's global predictor in a real federation: scored by the server every round on its own data
    (rounds.jsonl), written with the run's artifacts, and kept by every device (join --state-dir) as the final round
    message carried it; a device's copy exports and labels exactly as the server's does."""
    from export.artifact import load_artifact

    rows = [json.loads(line) for line in (started_default / "server" / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2] and all(isinstance(r["predictor_acc"], float) for r in rows), rows
    server = started_default / "server" / "artifacts" / "global" / art.PREDICTOR
    w, b, backbone, info = art.read_predictor(server)
    assert info["devices"] == 2 and info["backbone"] == "shipped" and backbone is not None, info
    _, test = load_dataset(DATA)
    want = torch_labels(load_artifact(started_default / "server" / "artifacts" / "global"), "logits", test.x)
    assert np.mean(want == test.y) == pytest.approx(rows[-1]["predictor_acc"], abs=0.02)  # 100 vs the val split
    for dev in ("dev-0", "dev-1"):
        kept = started_default / dev / "artifacts" / "devices" / dev / art.PREDICTOR
        w2, b2, backbone2, _ = art.read_predictor(kept)
        assert backbone2 is not None and np.array_equal(backbone2, backbone)
        assert np.array_equal(w2, w) and np.array_equal(b2, b)
    model = tmp_path / "kept.onnx"
    kept = started_default / "dev-1" / "artifacts" / "devices" / "dev-1" / art.PREDICTOR
    r = runner.invoke(export_app, ["onnx", "--from", str(kept), "--out", str(model), "--exporter", "torchscript"])
    assert r.exit_code == 0 and "as device dev-1 kept it" in r.output, r.output
    npz = tmp_path / "test.npz"
    np.savez(npz, x=test.x)
    labels = tmp_path / "labels.csv"
    done = edge_without_torch("predict", "--model", model, "--input", f"npz:{npz}", "--out", labels, "--show", "0")
    assert done.returncode == 0, done.stdout + done.stderr
    got = read_labels(labels)
    assert np.array_equal(np.array([got[str(i)] for i in range(len(test.y))]), want)


@pytest.mark.slow
def test_the_opted_in_route_keeps_g_bit_for_bit_on_every_device(started_route: Path) -> None:
    """The ridge predictor's route, opted in, in a real federation (`start` on Mosquitto, two `join`s): after 3 rounds
    the global model g (the backbone the devices refreshed, and its head) is bit for bit the server's on every device
    (join --state-dir), as the round messages carried it."""
    rows = [json.loads(line) for line in (started_route / "server" / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3] and all(isinstance(r["predictor_acc"], float) for r in rows), rows
    w, b, backbone, info = art.read_predictor(started_route / "server" / "artifacts" / "global" / art.PREDICTOR)
    assert info["devices"] == 2 and info["backbone"] == "refreshed by the devices" and backbone is not None, info
    # Version 3 of g: round 1's head, then two rounds of the devices' updates, which changed the backbone itself.
    assert info["version"] == 3 and info["backbone_changed"] > 0, info
    assert np.array_equal(backbone[-(w.size + b.size) :], np.concatenate([w.ravel(), b]))
    for dev in ("dev-0", "dev-1"):
        kept = started_route / dev / "artifacts" / "devices" / dev / art.PREDICTOR
        w2, b2, backbone2, _ = art.read_predictor(kept)
        assert backbone2 is not None and backbone2.tobytes() == backbone.tobytes()  # g, bit for bit
        assert np.array_equal(w2, w) and np.array_equal(b2, b)
