"""Class names are part of the federation (issue 42): `start --classes FILE` puts them in the config, every device
matches its class folders with them (a device of its own classes file, one without, numeric folders as ids), and a
folder the federation does not name is refused before anything is trained. Through the command lines: `start` and
three `join` processes on generated image folders holding different subsets of the classes; the server's upload
journal says which class ids each device uploaded, with how many samples."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from broker_server.core.journal import scan
from broker_server.ops.broker import free_port
from edge_agent.ops.local_data import DataSpec, load_client_data
from export.cli import app as export_app
from protofl import artifacts as art
from protofl.data import load_source
from protofl.errors import DataError
from protofl.presets import make_config
from protofl.wire import ProtoUpload, decode_message
from tests.test_deploy import ENV, join_process, start_process

CLASSES = ["cat", "dog", "Ankle boot", "T-shirt/top", "bird"]  # the federation's, in id order
SIZE = 16
# Each device's class folders -> how many training images (distinct counts: the journal's counts say which is which),
# and whether it brings a classes file of its own. dev-1's sorted folders (T-shirt_top, dog) read by their order
# were classes 0 and 1 (cat, dog): today's silent permutation.
DEVICES = {
    "dev-0": ({"ankle-boot": 9, "bird": 11}, True),
    "dev-1": ({"T-shirt_top": 7, "dog": 13}, False),
    "dev-2": ({"cat": 6, "4": 10}, False),  # "4": a numeric folder is the class id itself (bird)
}
TRUE_ID = {"ankle-boot": 2, "bird": 4, "T-shirt_top": 3, "dog": 1, "cat": 0, "4": 4}
runner = CliRunner()


def image_folder(root: Path, folders: dict[str, int], test_per_class: int = 3) -> Path:
    """DIR/train/<folder>/ with `folders[folder]` PNGs and DIR/test/<folder>/ with `test_per_class`: grey
    images whose brightness and stripe say the true class, so that a wrong label map also trains worse."""
    rng = np.random.default_rng(len(folders) + sum(folders.values()))
    for split, counts in (("train", folders), ("test", dict.fromkeys(folders, test_per_class))):
        for folder, n in counts.items():
            d = root / split / folder
            d.mkdir(parents=True, exist_ok=True)
            k = TRUE_ID[folder]
            for i in range(n):
                img = rng.integers(0, 40, (SIZE, SIZE)) + 40 * k
                img[:, 3 * k : 3 * k + 3] = 255
                Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "L").save(d / f"{i}.png")
    return root


def start(tmp: Path, port: int) -> subprocess.Popen[str]:
    (tmp / "classes.txt").write_text("\n".join(CLASSES) + "\n")
    return start_process(
        port, "names", tmp / "server", "--preset", "fedproto", "--classes", str(tmp / "classes.txt"),
        "--set", f"in_shape=1,{SIZE},{SIZE}", "--set", "proto_dim=64", "--rounds", "2", "--min-clients", "3",
        "--round-timeout", "60",
    )  # fmt: skip


def join(tmp: Path, port: int, dev: str, data: str) -> subprocess.Popen[str]:
    return join_process(port, "names", dev, tmp / dev, "--data", data)


def uploaded_counts(state_dir: Path) -> dict[str, dict[int, int]]:
    """Per device, class id -> samples, as the server's journal holds its last prototype upload."""
    out: dict[str, dict[int, int]] = {}
    journals = sorted(p for p in state_dir.rglob("*") if p.is_file() and _is_journal(p))
    assert journals, f"no upload journal under {state_dir}: {sorted(state_dir.rglob('*'))}"
    for path in journals:
        records, _ = scan(path.read_bytes(), path)
        for rec in records:
            if not rec.payload:
                continue
            try:
                _, msg = decode_message(bytes(rec.payload))
            except Exception:  # noqa: BLE001 - not every record is an upload this test reads
                continue
            local = msg.local if isinstance(msg, ProtoUpload) else None
            if local is not None and local.counts is not None:
                out[rec.client] = {int(c): int(n) for c, n in zip(local.classes, local.counts, strict=True)}
    return out


def _is_journal(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) in (b"PFJ3", b"PFJ2", b"PFJ1")


@pytest.mark.slow
def test_start_and_join_train_one_label_map_from_named_class_folders(tmp_path: Path) -> None:
    port = free_port()
    for dev, (folders, _) in DEVICES.items():
        image_folder(tmp_path / "data" / dev, folders)
    server = start(tmp_path, port)
    devices = {
        dev: join(
            tmp_path,
            port,
            dev,
            f"imagefolder:{tmp_path / 'data' / dev}" + (f",classes={tmp_path / 'classes.txt'}" if own_file else ""),
        )
        for dev, (_, own_file) in DEVICES.items()
    }
    # A device with a class folder the federation does not name is refused: exit 2, nothing trained.
    bad_dir = tmp_path / "data" / "dev-bad" / "train"
    for folder in ("bird", "horse"):
        (bad_dir / folder).mkdir(parents=True)
        for i in range(4):
            Image.fromarray(np.full((SIZE, SIZE), 60 * i, np.uint8), "L").save(bad_dir / folder / f"{i}.png")
    bad = join(tmp_path, port, "dev-bad", f"imagefolder:{tmp_path / 'data' / 'dev-bad' / 'train'}")
    try:
        bad_out, _ = bad.communicate(timeout=120)
        out, _ = server.communicate(timeout=300)
        dev_out = {dev: p.communicate(timeout=60)[0] for dev, p in devices.items()}
    finally:
        for p in (server, bad, *devices.values()):
            if p.poll() is None:
                p.kill()
    assert bad.returncode == 2, bad_out
    said = " ".join(bad_out.split())
    assert "['horse'] is not among this federation's 5 classes (cat, dog, Ankle boot, T-shirt/top, bird)" in said
    assert not (tmp_path / "dev-bad" / "artifacts").exists()
    assert server.returncode == 0, out
    assert all(p.returncode == 0 for p in devices.values()), dev_out

    # What the server got: each device's class ids are its folders' true classes, with their image counts.
    got = uploaded_counts(tmp_path / "server")
    want = {dev: {TRUE_ID[f]: n for f, n in folders.items()} for dev, (folders, _) in DEVICES.items()}
    assert got == want, (got, want)
    manifest = art.read_json(tmp_path / "server" / "artifacts" / art.MANIFEST)
    assert manifest["class_names"] == CLASSES and manifest["config"]["class_names"] == CLASSES
    assert manifest["prototypes"]["classes"] == [0, 1, 2, 3, 4]  # the union of the devices' classes
    table = art.read_prototypes(tmp_path / "dev-1" / "artifacts" / "devices" / "dev-1" / art.LOCAL)
    assert table.classes.tolist() == [1, 3] and list(table.class_names or ()) == ["dog", "T-shirt/top"]

    # predict --data on dev-1's named test folders scores against the model's class names, not the folder order.
    model = tmp_path / "deploy" / "model.onnx"
    artifact = tmp_path / "dev-1" / "artifacts"
    r = runner.invoke(export_app, ["onnx", "--from", str(artifact), "--out", str(model), "--exporter", "torchscript"])
    assert r.exit_code == 0, r.output
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "edge_agent.cli",
            "predict",
            "--model",
            str(model),
            "--data",
            f"imagefolder:{tmp_path / 'data' / 'dev-1'}",
            "--show",
            "6",
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    truths = sorted({line.rsplit("label ", 1)[1] for line in done.stdout.splitlines() if "predicted" in line})
    assert truths == ["1", "3"], done.stdout  # dog and T-shirt/top; by folder order they were 0 and 1


def _folders(root: Path, names: list[str]) -> None:
    for name in names:
        (root / name).mkdir(parents=True)
        for i in range(4):
            Image.fromarray(np.full((SIZE, SIZE), 30 * i, np.uint8), "L").save(root / name / f"{i}.png")


def test_a_device_maps_its_folders_onto_the_federation_s_names_or_is_refused(tmp_path: Path) -> None:
    cfg = make_config("fedproto", class_names=CLASSES, in_shape=(1, SIZE, SIZE))
    assert cfg.num_classes == 5 and cfg.to_dict()["class_names"] == CLASSES
    assert "class_names" not in make_config("fedproto").to_dict()  # a federation without names sends the same bytes
    _folders(tmp_path / "dev", ["t-shirt TOP", "Cat", "2"])
    data = load_client_data(DataSpec(str(tmp_path / "dev")), cfg, "d")
    assert sorted(set(data.y_train.tolist()) | set(data.y_test.tolist())) == [0, 2, 3]
    # Its own classes file, when it disagrees with the federation's, is refused with both lists.
    (tmp_path / "mine.txt").write_text("cat\ndog\nbird\n")
    with pytest.raises(DataError, match=r"names 3 classes \(cat, dog, bird\), but this federation's 5 classes are"):
        load_client_data(DataSpec(f"imagefolder:{tmp_path / 'dev'},classes={tmp_path / 'mine.txt'}"), cfg, "d")
    _folders(tmp_path / "two", ["cat", "CAT"])
    with pytest.raises(DataError, match=r"\['CAT', 'cat'\] are all 'cat': one folder per class"):
        load_client_data(DataSpec(str(tmp_path / "two")), cfg, "d")
    # A federation without names: named folders of a subset of its classes cannot be told apart by their order.
    _folders(tmp_path / "sub", ["bag", "shirt"])
    with pytest.raises(DataError, match=r"2 named class folder\(s\) \(bag, shirt\) in a federation of 10 classes"):
        load_client_data(DataSpec(str(tmp_path / "sub")), make_config("fedproto", in_shape=(1, SIZE, SIZE)), "d")


def test_a_csv_s_label_names_are_matched_with_the_federation_s(tmp_path: Path) -> None:
    rows = ["label,a,b,c,d"] + [f"{n},1,2,3,{i}" for i, n in enumerate(["dog", "Ankle boot", "dog", "4", "bird"])]
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n")
    train, _ = load_source(f"csv:{tmp_path / 't.csv'}", in_shape=(1, 2, 2), num_classes=5, holdout=None,
                           class_names=CLASSES)  # fmt: skip
    assert train.y.tolist() == [1, 2, 1, 4, 4]
    with pytest.raises(DataError, match=r"holds class names \(Ankle boot, bird, dog\), but this federation names no"):
        load_source(f"csv:{tmp_path / 't.csv'}", in_shape=(1, 2, 2), num_classes=5, holdout=None)
    (tmp_path / "u.csv").write_text("label,a,b,c,d\nhorse,1,2,3,4\n")
    with pytest.raises(DataError, match=r"label\(s\) in column 'label' \['horse'\] is not among"):
        load_source(f"csv:{tmp_path / 'u.csv'}", in_shape=(1, 2, 2), num_classes=5, holdout=None, class_names=CLASSES)


def test_simulate_takes_the_names_from_classes_or_the_class_folders(tmp_path: Path) -> None:
    from broker_server.cli import app as server_app

    image_folder(tmp_path / "imgs", {"ankle-boot": 12, "dog": 12, "4": 12})
    (tmp_path / "classes.txt").write_text("\n".join(CLASSES) + "\n")
    common = ["--preset", "fedproto", "--set", f"in_shape=1,{SIZE},{SIZE}", "--set", "public_per_class=0",
              "--set", "proto_dim=32", "--clients", "2", "--rounds", "1", "--quiet"]  # fmt: skip
    r = runner.invoke(
        server_app,
        [
            "simulate",
            "--dataset",
            f"imagefolder:{tmp_path / 'imgs'}",
            "--classes",
            str(tmp_path / "classes.txt"),
            *common,
            "--out",
            str(tmp_path / "out"),
        ],  # fmt: skip
    )
    assert r.exit_code == 0, r.output
    manifest = art.read_json(tmp_path / "out" / art.MANIFEST)
    assert manifest["config"]["class_names"] == CLASSES and manifest["config"]["num_classes"] == 5
    assert set(manifest["prototypes"]["classes"]) <= {1, 2, 4} and manifest["class_names"] == CLASSES
    # Without --classes the class folders name the classes (their sorted order, as before).
    r = runner.invoke(server_app, ["simulate", "--dataset", f"imagefolder:{tmp_path / 'imgs'}", *common,
                                   "--out", str(tmp_path / "own")])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert art.read_json(tmp_path / "own" / art.MANIFEST)["config"]["class_names"] == ["4", "ankle-boot", "dog"]


def test_start_names_the_classes_from_its_public_data_unless_it_resumes_a_federation_without_names(
    tmp_path: Path,
) -> None:
    from broker_server.commands.start_cli import _federation

    _folders(tmp_path / "public", ["bird", "cat", "dog"])
    spec = f"imagefolder:{tmp_path / 'public'}"
    args = (None, None, None, None, spec, None)  # rounds, min_clients, round_timeout, seed, --public-data, --data-dir
    cfg, _, _, _, _ = _federation("fedproto", None, {"in_shape": [1, SIZE, SIZE]}, *args)
    assert cfg.class_names == ("bird", "cat", "dog") and cfg.num_classes == 3
    named = {"in_shape": [1, SIZE, SIZE], "class_names": ["dog", "cat", "bird"]}
    cfg, _, _, _, _ = _federation("fedproto", None, named, *args)
    assert cfg.class_names == ("dog", "cat", "bird")  # --classes wins; the folders are matched by name
    (tmp_path / "state" / "aggregator").mkdir(parents=True)
    (tmp_path / "state" / "aggregator" / "federation.json").write_text(
        json.dumps({"fed": "f", "config": make_config("fedproto").to_dict()})
    )
    cfg, _, _, _, _ = _federation(
        "fedproto", None, {"in_shape": [1, SIZE, SIZE]}, *args, None, None, tmp_path / "state"
    )
    assert cfg.class_names is None and cfg.num_classes == 3  # a federation started without names resumes so
