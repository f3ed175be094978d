"""`protofl-server simulate` on a field trial's own data: an RGB image folder and a CSV file, written by the
test, shaped by `--set in_shape` / `--set num_classes`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image
from typer.testing import CliRunner

from broker_server.cli import app

runner = CliRunner()


def test_simulate_an_rgb_image_folder_of_five_classes(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    for k, name in enumerate(["ant", "bee", "cat", "dog", "eel"]):
        (tmp_path / "imgs" / name).mkdir(parents=True)
        colour = np.array([(k * 50) % 256, (255 - k * 60) % 256, (k * 97) % 256])
        for i in range(16):
            size = (32, 32) if i % 4 else (48, 36)  # a few of another size: resized to 32x32
            img = np.clip(colour + rng.integers(-30, 30, (size[1], size[0], 3)), 0, 255).astype(np.uint8)
            Image.fromarray(img, "RGB").save(tmp_path / "imgs" / name / f"{i}.{'png' if i % 2 else 'jpg'}")
    out = tmp_path / "r.json"
    res = runner.invoke(
        app,
        [
            "simulate",
            "--preset",
            "fedproto",
            "--dataset",
            f"imagefolder:{tmp_path / 'imgs'}",
            "--set",
            "in_shape=3,32,32",
            "--set",
            "num_classes=5",
            "--set",
            "public_per_class=0",
            "--clients",
            "2",
            "--rounds",
            "2",
            "--json",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert report["config"]["in_shape"] == [3, 32, 32] and report["config"]["num_classes"] == 5
    assert len(report["rounds"]) == 2 and report["rounds"][-1]["local_acc"] is not None
    # The federation's shape is the truth: a folder of 5 classes in a 4-class federation says so.
    res = runner.invoke(
        app,
        [
            "simulate",
            "--dataset",
            f"imagefolder:{tmp_path / 'imgs'}",
            "--set",
            "num_classes=4",
            "--set",
            "in_shape=3,32,32",
        ],
    )
    assert res.exit_code == 2 and "label 4 out of range for 4 classes" in " ".join(res.output.split())


def test_simulate_a_csv_dataset(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    y = rng.integers(0, 4, 240)
    x = rng.normal(0, 1, (4, 64))[y] + 0.5 * rng.normal(0, 1, (240, 64))
    rows = ["target," + ",".join(f"f{i}" for i in range(64))]
    rows += [f"{c}," + ",".join(f"{v:.4f}" for v in row) for c, row in zip(y, x, strict=True)]
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n")
    out = tmp_path / "c.json"
    res = runner.invoke(
        app,
        [
            "simulate",
            "--preset",
            "fedproto",
            "--dataset",
            f"csv:{tmp_path / 't.csv'},label=target,range=-4:4",
            "--set",
            "in_shape=1,8,8",
            "--set",
            "public_per_class=0",
            "--clients",
            "2",
            "--rounds",
            "2",
            "--json",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert report["config"]["in_shape"] == [1, 8, 8] and report["config"]["num_classes"] == 4  # from the labels
    assert report["rounds"][-1]["local_acc"] > 0.35  # it learns from the features: chance 0.25, measured 0.48
    res = runner.invoke(
        app, ["simulate", "--dataset", f"csv:{tmp_path / 't.csv'},label=target,range=-4:4", "--set", "in_shape=1,9,9"]
    )
    said = " ".join(res.output.split())  # the terminal wraps the message
    assert res.exit_code == 2 and "64 feature columns, but the federation's in_shape (1, 9, 9) needs 1x9x9 = 81" in said
