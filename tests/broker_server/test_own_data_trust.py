"""Own data a newcomer can trust (issue 42): `simulate` and `predict` on generated image folders and CSVs
with broken files, mixed-scale columns and separate test files; say what was loaded, skipped and converted;
fail early (before torch) on a wrong path or spec, and draw no progress bar before the inputs are checked."""

from __future__ import annotations

import csv
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from broker_server.cli import app
from export.cli import app as export_app
from tests.test_packaging import run_without_torch

runner = CliRunner()
CLASSES = ["ant", "bee", "cat"]


def image_folder(root: Path, n: int = 12, broken: bool = True) -> Path:
    """3 class folders of n RGB images 16x16 (a grey one, an RGBA one, one of 30x20 in each), plus, if
    `broken`, a zero-byte PNG, a truncated JPEG and a README.txt."""
    rng = np.random.default_rng(0)
    for k, name in enumerate(CLASSES):
        d = root / name
        d.mkdir(parents=True, exist_ok=True)
        colour = np.array([k * 100, 255 - k * 100, (k * 70) % 256])
        for i in range(n):
            im = Image.fromarray(np.clip(colour + rng.integers(-30, 30, (16, 16, 3)), 0, 255).astype(np.uint8), "RGB")
            im = {0: im.convert("L"), 1: im.convert("RGBA"), 2: im.resize((30, 20))}.get(i, im)
            im.save(d / f"{i}.{'png' if i % 2 else 'jpg'}")
    if broken:
        (root / "ant" / "empty.png").write_bytes(b"")
        good = (root / "bee" / "0.jpg").read_bytes()
        (root / "bee" / "cut.jpg").write_bytes(good[: len(good) // 2])
        (root / "cat" / "README.txt").write_text("photos of June\n")
    return root


def simulate(dataset: str, *extra: str, shape: str = "3,16,16", classes: int = 3) -> tuple[int, str, dict | None]:
    out = Path(dataset.split(":", 1)[1].split(",")[0]).parent / "report.json"
    out.unlink(missing_ok=True)
    args = ["simulate", "--preset", "fedproto", "--dataset", dataset, "--arch", "mlp", "--clients", "2"]
    args += ["--rounds", "2", "--set", f"in_shape={shape}", "--set", f"num_classes={classes}"]
    args += ["--set", "public_per_class=0", "--json", str(out), *extra]
    res = runner.invoke(app, args)
    # rich wraps long lines, in the middle of a word too: compare without whitespace (see `has`)
    return res.exit_code, "".join(res.output.split()), json.loads(out.read_text()) if out.is_file() else None


def has(out: str, text: str) -> bool:
    return "".join(text.split()) in out


def test_simulate_skips_unreadable_files_and_says_what_it_loaded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    imgs = image_folder(tmp_path / "imgs")
    with caplog.at_level(logging.INFO, logger="protofl.data"):
        code, out, report = simulate(f"imagefolder:{imgs}")
    assert code == 0, out
    said = " ".join(caplog.text.split())
    assert "loaded 36 image(s); skipped 3: ant/empty.png (empty file), bee/cut.jpg (cannot decode" in said, said
    assert "cat/README.txt (not an image file)" in said
    assert "converted 3 L to RGB, 3 RGBA to RGB, 3 resized from 30x20" in said, said
    # strict=true: the first unreadable file stops loading, and names it
    code, out, _ = simulate(f"imagefolder:{imgs},strict=true")
    assert code == 2 and has(out, "empty.png: empty file (strict"), out
    # more than half the image files unreadable: the wrong folder, not a few broken files
    for p in list((imgs / "cat").glob("*.*"))[:10]:
        p.write_bytes(b"not an image")
    for p in list((imgs / "bee").glob("*.*"))[:10]:
        p.write_bytes(b"")
    code, out, _ = simulate(f"imagefolder:{imgs}")
    assert code == 2 and has(out, "image files are unreadable (more than 50%"), out


def test_an_image_folder_of_train_without_test(tmp_path: Path) -> None:
    imgs = image_folder(tmp_path / "imgs" / "train", broken=False).parent
    code, out, report = simulate(f"imagefolder:{imgs}")
    assert code == 0, out
    assert report is not None and report["config"]["num_classes"] == 3
    names = tmp_path / "classes.txt"
    names.write_text("\n".join(CLASSES) + "\n")
    code, out, _ = simulate(f"imagefolder:{imgs},classes={names}")
    assert code == 0, out


def mixed_scale_csv(path: Path, n: int, seed: int, names: bool = False) -> np.ndarray:
    """Sensor-like rows of 3 classes whose 8 columns have scales from 1e-3 to 1e4 (and offsets)."""
    rng = np.random.default_rng(seed)
    centres = np.random.default_rng(99).normal(0, 1, (3, 8))
    scale = 10.0 ** np.arange(-3, 5)
    y = rng.integers(0, 3, n)
    x = (centres[y] + 0.35 * rng.normal(0, 1, (n, 8))) * scale + 5 * scale
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["label", *(f"s{i}" for i in range(8))])
        w.writerows([int(c), *(f"{v:.6g}" for v in row)] for c, row in zip(y, x, strict=True))
    return y


def test_csv_columns_standardised_a_test_file_and_predict_applies_the_same(tmp_path: Path) -> None:
    mixed_scale_csv(tmp_path / "train.csv", 300, 1)
    y_test = mixed_scale_csv(tmp_path / "test.csv", 90, 2)
    run = tmp_path / "run"
    code, out, report = simulate(
        f"csv:{tmp_path / 'train.csv'},test={tmp_path / 'test.csv'}", "--out", str(run), shape="1,1,8"
    )
    assert code == 0 and report is not None, out
    assert report["rounds"][-1]["global_proto_acc"] >= 0.9, report["rounds"][-1]
    assert len(y_test) == 90 and has(out, "the test set (90 images)"), out  # the test file is the test split
    device = run / "devices" / "client-000"
    scaling = json.loads((device / "device.json").read_text())["csv_scaling"]
    assert scaling["kind"] == "column" and scaling["columns"] == [f"s{i}" for i in range(8)]
    model = tmp_path / "deploy" / "model.onnx"
    r = runner.invoke(export_app, ["onnx", "--from", str(device), "--out", str(model), "--exporter", "torchscript"])
    assert r.exit_code == 0, r.output
    labels = tmp_path / "labels.csv"
    source = f"csv:{tmp_path / 'test.csv'}"
    done = run_without_torch("protofl-edge", "predict", "--model", str(model), "--input", source, "--out", str(labels))
    assert done.returncode == 0, done.stdout + done.stderr
    with labels.open() as f:
        got = np.array([int(row["class"]) for row in csv.DictReader(f)])
    assert np.mean(got == y_test) >= 0.9, np.mean(got == y_test)


def test_a_non_numeric_cell_names_its_row_and_column_before_any_progress_bar(tmp_path: Path) -> None:
    mixed_scale_csv(tmp_path / "t.csv", 60, 3)
    lines = (tmp_path / "t.csv").read_text().splitlines()
    cells = lines[5].split(",")
    cells[4] = "n/a"
    lines[5] = ",".join(cells)
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    code, out, _ = simulate(f"csv:{tmp_path / 't.csv'}", shape="1,1,8")
    assert code == 2 and has(out, "line 6, column 's3' (column 5): 'n/a' is not a number"), out
    assert "rounds" not in out, out  # no progress bar was drawn for a run that never started


@pytest.mark.parametrize(
    "args",
    [
        ["protofl-server", "simulate", "--dataset", "imagefolder:/no/such/folder"],
        ["protofl-server", "simulate", "--dataset", "csv:{csv},test=/no/such/test.csv"],
        ["protofl-server", "simulate", "--dataset", "csv:{csv},scale=sideways"],
    ],
    ids=["path", "test-file", "option"],
)
def test_a_wrong_dataset_path_or_spec_fails_before_torch(tmp_path: Path, args: list[str]) -> None:
    mixed_scale_csv(tmp_path / "t.csv", 10, 0)
    argv = [a.format(csv=tmp_path / "t.csv", dir=tmp_path) for a in args]
    done = run_without_torch(*argv)  # torch cannot be imported: the error must come first
    said = done.stdout + done.stderr
    assert done.returncode == 2 and "torch" not in said, said
    assert any(w in said for w in ("not found", "scale=column", "strict=true")), said


def test_join_checks_its_data_before_importing_torch(tmp_path: Path) -> None:
    """`join` needs torch installed (said first where it is missing) but checks --data before importing it
    (today: 19 s of importing torch before "not found")."""
    for data in (f"imagefolder:{tmp_path},strict=maybe", f"csv:{tmp_path / 'missing.csv'}"):
        done = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "edge_agent.cli", "join", "--client-id", "d1", "--data", data],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])),
        )
        errors = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
        imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import")]
        assert done.returncode == 2 and any(w in "\n".join(errors) for w in ("strict=true", "not found")), errors
        assert "torch" not in imported, "torch was imported before the data was checked"


def test_predict_labels_the_readable_images_and_lists_the_rest(tmp_path: Path) -> None:
    imgs = image_folder(tmp_path / "imgs", broken=False)
    run = tmp_path / "run"
    code, out, _ = simulate(f"imagefolder:{imgs}", "--out", str(run))
    assert code == 0, out
    model = tmp_path / "deploy" / "model.onnx"
    device = run / "devices" / "client-000"
    r = runner.invoke(export_app, ["onnx", "--from", str(device), "--out", str(model), "--exporter", "torchscript"])
    assert r.exit_code == 0, r.output
    new = tmp_path / "new"
    image_folder(new, n=4)  # 12 readable images, an empty PNG, a truncated JPEG (and a README.txt: not an image)
    labels = tmp_path / "labels.csv"
    args = ["--model", str(model), "--input", str(new), "--out", str(labels)]
    done = run_without_torch("protofl-edge", "predict", *args)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "skipped 2 file(s) that could not be read" in done.stdout, done.stdout
    assert "ant/empty.png: empty file" in done.stdout and "bee/cut.jpg: cannot decode" in done.stdout, done.stdout
    with labels.open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 12 and {r["sample"].split("/")[0] for r in rows} == set(CLASSES)


@pytest.mark.slow
@pytest.mark.mosquitto
def test_join_says_what_it_loaded_and_trains_past_broken_files(tmp_path: Path) -> None:
    """`start` and one `join` on an image folder with a zero-byte PNG, a truncated JPEG and a README.txt: the
    device's log says what it loaded, skipped and converted, and it trains (today: exit 2 at the first)."""
    from tests.broker_server.mqtt_helpers import start_and_join
    from tests.conftest import _require_mosquitto

    _require_mosquitto()
    imgs = image_folder(tmp_path / "imgs", n=8)
    code, dev_out, server_code, out = start_and_join(tmp_path, "own42", f"imagefolder:{imgs}")
    assert code == 0, dev_out  # (a device that stops at a broken file: the server is killed)
    assert server_code == 0, out
    said = " ".join(dev_out.split())
    assert "loaded 24 image(s); skipped 3: ant/empty.png (empty file), bee/cut.jpg (cannot decode" in said, dev_out
    assert "cat/README.txt (not an image file); converted 3 L to RGB, 3 RGBA to RGB, 3 resized from 30x20" in said
