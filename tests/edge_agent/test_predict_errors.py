"""`protofl-edge predict` through the real command (issue 59, item 4): onnxruntime's refusals of a crafted model and
an `--out` it cannot write end in one `error:` line (exit 2, no traceback); an input folder of class folders named
after the model's classes gets its accuracy and a `label` column; `--help` says what `score` and `distance` are."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edge_agent.inference.onnx_export import export_onnx
from edge_agent.training.models import build_model
from tests.broker_server.crash_helpers import env

CLASSES = ["shirt", "Ankle boot", "bag"]


def predict(*args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "edge_agent.cli", "predict", *args],
        capture_output=True,
        text=True,
        env=env(OMP_NUM_THREADS="1"),
        timeout=120,
    )
    assert "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
    return done


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("predict") / "logits.onnx"
    net = build_model("mlp", (1, 12, 12), len(CLASSES), seed=0)
    export_onnx(net, out, what="logits", exporter="torchscript", metadata={"class_names": json.dumps(CLASSES)})
    return out


def photos(root: Path, folders: list[str]) -> Path:
    from PIL import Image

    rng = np.random.default_rng(1)
    for name in folders:
        (root / name).mkdir(parents=True)
        for i in range(3):
            Image.fromarray(rng.integers(0, 255, (12, 12), dtype=np.uint8)).save(root / name / f"{i}.png")
    return root


def crafted(model: Path, out: Path, change: str) -> Path:
    import onnx

    proto = onnx.load(str(model))
    if change == "op":
        proto.graph.node[0].op_type = "NoSuchOp"  # onnx.load takes it; onnxruntime refuses the graph
    else:
        said = {"in_shape": "3,12,12", "norm_mean": "0,0,0", "norm_std": "1,1,1"} if change == "shape" else {}
        for prop in proto.metadata_props:  # the graph takes 1 channel; the metadata says 3
            if prop.key == "in_shape":
                prop.value = said.get("in_shape", "twelve")
            elif prop.key in said:
                prop.value = said[prop.key]
    onnx.save(proto, str(out))
    return out


def test_predict_says_what_onnxruntime_refused_and_what_it_cannot_write(model: Path, tmp_path: Path) -> None:
    folder = photos(tmp_path / "in", ["x"])
    bad_op = predict("--model", str(crafted(model, tmp_path / "op.onnx", "op")), "--input", str(folder))
    assert bad_op.returncode == 2 and "error: onnxruntime cannot load" in bad_op.stderr, bad_op.stderr
    assert "export it again" in bad_op.stderr
    shape = predict("--model", str(crafted(model, tmp_path / "shape.onnx", "shape")), "--input", str(folder))
    assert shape.returncode == 2 and "error: onnxruntime refused to run the model" in shape.stderr, shape.stderr
    meta = predict("--model", str(crafted(model, tmp_path / "meta.onnx", "meta")), "--input", str(folder))
    assert meta.returncode == 2 and "metadata in_shape='twelve' does not read" in meta.stderr, meta.stderr
    full = predict("--model", str(model), "--input", str(folder), "--out", "/dev/full")
    assert full.returncode == 2 and "error: --out /dev/full: cannot write the labels" in full.stderr, full.stderr


def test_predict_scores_an_input_of_class_folders(model: Path, tmp_path: Path) -> None:
    folder = photos(tmp_path / "held-out", ["Shirt", "ankle-boot", "2"])  # as join matches them: bag is id 2
    out = tmp_path / "labels.csv"
    done = predict("--model", str(model), "--input", f"imagefolder:{folder}", "--out", str(out))
    assert done.returncode == 0, done.stderr
    rows = list(csv.DictReader(out.open()))
    assert list(rows[0]) == ["sample", "class", "class_name", "score", "label"], rows[0]
    want = {"Shirt": 0, "ankle-boot": 1, "2": 2}
    assert all(int(r["label"]) == want[r["sample"].split("/")[0]] for r in rows), rows
    right = sum(r["class"] == r["label"] for r in rows)
    assert f"accuracy {100 * right / 9:.2f}% ({right}/9)" in done.stdout, done.stdout
    assert all(0 < float(r["score"]) <= 1 for r in rows)

    other = photos(tmp_path / "other", ["shirt", "hat"])  # a folder the model does not name: no accuracy
    done = predict("--model", str(model), "--input", str(other))
    assert done.returncode == 0 and "accuracy" not in done.stdout, done.stdout

    helped = predict("--help")
    text = " ".join(helped.stdout.split())
    assert "softmax probability" in text and "nearest prototype" in text, helped.stdout
