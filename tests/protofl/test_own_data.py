"""A field trial's own data (`protofl.data.own` through `load_dataset`/`load_source`): image folders, CSV
files, npz test splits, a loader function of one's own, and the federation's classes and shape as the truth.
Every file is written by the test."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from broker_server.cli_common import parse_sets
from protofl.data import load_dataset, load_source
from protofl.errors import ConfigError, DataError
from protofl.presets import make_config


def _folder(root: Path, classes: list[str], per_class: int, size: tuple[int, int], mode: str = "RGB") -> None:
    """Class k's images are filled with the value 40 * (k + 1) (plus a per-image offset), size (w, h)."""
    for k, name in enumerate(classes):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            value = 40 * (k + 1) + i
            Image.new(mode, size, (value,) * 3 if mode == "RGB" else value).save(root / name / f"{i}.png")


def test_imagefolder_resizes_to_the_federations_shape(tmp_path: Path) -> None:
    _folder(tmp_path / "d", ["cat", "ant", "bee"], 4, (20, 12))  # 20 wide, 12 high
    (tmp_path / "d" / "bee" / "notes.txt").write_text("not an image: skipped")
    train, test = load_source(f"imagefolder:{tmp_path / 'd'}", in_shape=(3, 8, 8), num_classes=3, holdout=None)
    assert test is None and train.x.shape == (12, 3, 8, 8) and train.num_classes == 3
    # Sorted folder names are the classes: ant=0, bee=1, cat=2 (cat was made first, with value 40).
    assert train.class_counts().tolist() == [4, 4, 4]
    assert train.x[train.y == 2].max() == 43 and train.x[train.y == 0].min() == 80
    grey, _ = load_dataset(f"imagefolder:{tmp_path / 'd'}", in_shape=(1, 5, 6))  # RGB -> L, 6 wide, 5 high
    assert grey.x.shape[1:] == (1, 5, 6)
    own, _ = load_dataset(f"imagefolder:{tmp_path / 'd'}")  # no federation shape: the first image's, RGB
    assert own.in_shape == (3, 12, 20)
    with pytest.raises(DataError, match=r"1 \(L\) or 3 \(RGB\) channels"):
        load_dataset(f"imagefolder:{tmp_path / 'd'}", in_shape=(2, 8, 8))
    with pytest.raises(DataError, match="not found"):
        load_dataset(f"imagefolder:{tmp_path / 'nothing'}")


def test_imagefolder_subsets_splits_and_class_files(tmp_path: Path) -> None:
    _folder(tmp_path / "num", ["3", "7"], 2, (8, 8), "L")  # numeric folders: the labels themselves
    train, _ = load_source(f"imagefolder:{tmp_path / 'num'}", in_shape=(1, 8, 8), num_classes=10, holdout=None)
    assert sorted(set(train.y.tolist())) == [3, 7] and train.num_classes == 10
    with pytest.raises(DataError, match=r"label 7 out of range for 5 classes.*labels 0\.\.4"):
        load_dataset(f"imagefolder:{tmp_path / 'num'}", in_shape=(1, 8, 8), num_classes=5)
    # A class file names the federation's classes: a device holding only 'dog' and 'ant' labels them 3 and 0.
    _folder(tmp_path / "named" / "train", ["dog", "ant"], 3, (8, 8))
    _folder(tmp_path / "named" / "test", ["dog"], 2, (8, 8))
    # Without a class file the test split is labelled like the train split: ant=0, cat=1, dog=2 (no cat in test).
    _folder(tmp_path / "split" / "train", ["ant", "cat", "dog"], 2, (8, 8))
    _folder(tmp_path / "split" / "test", ["ant", "dog"], 1, (8, 8))
    train, test = load_source(f"imagefolder:{tmp_path / 'split'}", holdout=None)
    assert test is not None and test.y.tolist() == [0, 2] and train.y.tolist() == [0, 0, 1, 1, 2, 2]
    (tmp_path / "classes.txt").write_text("ant\nbee\ncat\ndog\n")
    train, test = load_source(
        f"imagefolder:{tmp_path / 'named'},classes={tmp_path / 'classes.txt'}",
        in_shape=(3, 8, 8),
        num_classes=4,
        holdout=None,
    )
    assert test is not None and len(train) == 6 and len(test) == 2  # DIR/train and DIR/test: its own test split
    assert sorted(set(train.y.tolist())) == [0, 3] and test.y.tolist() == [3, 3]
    (tmp_path / "classes.txt").write_text("bee\n")
    with pytest.raises(DataError, match=r"not in the classes file"):
        load_dataset(f"imagefolder:{tmp_path / 'named'},classes={tmp_path / 'classes.txt'}")


def _csv(path: Path, x: np.ndarray, y: np.ndarray, label: str = "label") -> None:
    cols = [f"f{i}" for i in range(x.shape[1])]
    lines = [",".join([label, *cols])]
    lines += [",".join([str(int(c)), *(f"{v:g}" for v in row)]) for c, row in zip(y, x, strict=True)]
    path.write_text("\n".join(lines) + "\n")


def test_csv_reshapes_to_the_federations_shape(tmp_path: Path) -> None:
    x = np.arange(10 * 12).reshape(10, 12) % 256
    _csv(tmp_path / "a.csv", x, np.arange(10) % 3, label="target")
    train, test = load_dataset(f"csv:{tmp_path / 'a.csv'},label=target", in_shape=(3, 2, 2), num_classes=4, seed=1)
    assert train.x.shape[1:] == (3, 2, 2) and len(train) + len(test) == 10 and train.num_classes == 4
    row = np.flatnonzero((x[:, 0][:, None] == train.x[:, 0, 0, 0][None, :]).any(axis=1))[0]
    np.testing.assert_array_equal(train.x[0].ravel(), x[row])  # channel, row, column order
    with pytest.raises(
        DataError,
        match=r"12 feature columns, but the federation's in_shape \(1, 4, 4\) needs "
        r"1x4x4 = 16",
    ):
        load_dataset(f"csv:{tmp_path / 'a.csv'},label=target", in_shape=(1, 4, 4))
    with pytest.raises(DataError, match="no label column 'label'.*label=COLUMN"):
        load_dataset(f"csv:{tmp_path / 'a.csv'}")
    # Features outside the pixel ranges are standardised per column (issue 42), or take a fixed range=LO:HI
    # (clipped), the same on every device; scale=pixels insists on pixel values.
    _csv(tmp_path / "b.csv", np.array([[-1.0, 0.0, 1.0, 3.0]] * 4), np.array([0, 1, 0, 1]))
    with pytest.raises(DataError, match=r"range=-1:3.*scale=column"):
        load_dataset(f"csv:{tmp_path / 'b.csv'},scale=pixels")
    train, _ = load_source(f"csv:{tmp_path / 'b.csv'}", holdout=None)
    assert train.x[0].ravel().tolist() == [128] * 4  # constant columns: their mean, the middle of 0..255
    train, _ = load_source(f"csv:{tmp_path / 'b.csv'},range=-1:1", holdout=None)
    assert train.in_shape == (1, 2, 2) and train.x[0].ravel().tolist() == [0, 128, 255, 255]
    with pytest.raises(DataError, match="not found"):
        load_dataset(f"csv:{tmp_path / 'none.csv'}")


def test_npz_keeps_its_test_split_and_the_federation_decides(tmp_path: Path) -> None:
    x = np.zeros((12, 1, 4, 4), np.uint8)
    np.savez(tmp_path / "own.npz", x=x, y=np.arange(12) % 6, x_test=x[:5], y_test=np.arange(5))
    train, test = load_source(f"npz:{tmp_path / 'own.npz'}", in_shape=(1, 4, 4), num_classes=10, holdout=None)
    assert test is not None and (len(train), len(test)) == (12, 5) and train.num_classes == 10  # classes 0-5 of 10
    np.savez(tmp_path / "plain.npz", x=x, y=np.arange(12) % 6)
    train, test = load_source(f"npz:{tmp_path / 'plain.npz'}", holdout=None)
    assert test is None and len(train) == 12  # no test split: the device holds one back, once
    with pytest.raises(DataError, match=r"images are \(1, 4, 4\).*federation expects in_shape \(3, 32, 32\)"):
        load_dataset(f"npz:{tmp_path / 'own.npz'}", in_shape=(3, 32, 32))
    with pytest.raises(DataError, match="not found"):
        load_dataset(f"npz:{tmp_path / 'none.npz'}")


def test_a_loader_function_of_ones_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "trialdata.py").write_text(
        textwrap.dedent("""
        import numpy as np

        def load(in_shape, num_classes):
            c, h, w = in_shape
            x = np.full((8, h, w, c), 0.5, np.float32)  # channels-last floats in [0, 1]
            return x, np.arange(8) % 2, x[:3], np.array([0, 1, 1])

        def bare():
            return np.zeros((6, 5, 5), np.uint8), np.arange(6) % 3

        def broken():
            return np.zeros((2, 5, 5), np.uint8)
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    train, test = load_source("trialdata:load", in_shape=(3, 6, 6), num_classes=4, holdout=None)
    assert test is not None and train.x.shape == (8, 3, 6, 6) and int(train.x.max()) == 128 and len(test) == 3
    train, test = load_dataset("trialdata:bare", seed=0)
    assert train.in_shape == (1, 5, 5) and len(train) + len(test) == 6
    with pytest.raises(DataError, match=r"must return \(x, y\) or \(x, y, x_test, y_test\)"):
        load_dataset("trialdata:broken")
    with pytest.raises(DataError, match="cannot import no_such_module"):
        load_dataset("no_such_module.sub:load")
    sys.modules.pop("trialdata", None)


def test_set_in_shape_takes_a_comma_list() -> None:
    sets = parse_sets(["in_shape=3,32,32", "archs=cnn,mlp", "mu=auto", "public_classes=[0,1]"])
    assert sets == {"in_shape": [3, 32, 32], "archs": "cnn,mlp", "mu": "auto", "public_classes": [0, 1]}
    assert make_config("fedproto", **sets).in_shape == (3, 32, 32)
    with pytest.raises(ConfigError, match=r"in_shape must be \(channels, height, width\)"):
        make_config("fedproto", **parse_sets(["in_shape=3x32x32"]))


def test_pillow_is_imported_only_to_read_an_image_folder(tmp_path: Path) -> None:
    # The numpy-only side imports no Pillow; without it, an image folder says which extra to install.
    import subprocess

    _folder(tmp_path / "d", ["a", "b"], 1, (4, 4))
    code = textwrap.dedent(f"""
        import sys
        sys.modules["PIL"] = None  # Pillow not installed: importing it raises ImportError
        import protofl.data
        from protofl.errors import DataError
        assert sys.modules["PIL"] is None  # nothing imported it
        try:
            protofl.data.load_dataset("imagefolder:{tmp_path / "d"}")
        except DataError as e:
            print(e)
    """)
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    ).stdout
    assert "needs Pillow: pip install 'protofl-edge[device]'" in out
