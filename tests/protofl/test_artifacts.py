"""The deployable artifacts' files (protofl/artifacts.py), the global predictor rule, and data to label
(protofl/data/unlabelled.py): numpy only."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from protofl import artifacts as art
from protofl.data.classnames import FASHION_MNIST_CLASSES, class_names
from protofl.data.unlabelled import load_unlabelled
from protofl.errors import DataError
from protofl.presets import make_config


def test_prototype_file_round_trip_with_metric_names_and_counts(tmp_path: Path) -> None:
    table = {3: np.ones(4, np.float32), 0: np.arange(4, dtype=np.float32)}
    names = ["zero", "one", "two", "three"]
    path = art.write_prototypes(
        tmp_path / "p.npz", table, metric="cosine", class_names=names, source="global", counts={0: 5, 3: 2}
    )
    got = art.read_prototypes(path)
    assert got.classes.tolist() == [0, 3] and got.metric == "cosine" and got.source == "global"
    assert got.class_names == ("zero", "three") and got.name_of(3) == "three"
    assert np.array_equal(got.table()[0], table[0])
    with np.load(path, allow_pickle=False) as f:  # plain arrays: nothing needs pickle
        assert f["counts"].tolist() == [5, 2]


def test_a_prototype_file_without_the_arrays_says_what_it_needs(tmp_path: Path) -> None:
    np.savez(tmp_path / "bad.npz", classes=np.arange(2), values=np.zeros((2, 4)))
    with pytest.raises(DataError, match="needs arrays 'classes'"):
        art.read_prototypes(tmp_path / "bad.npz")
    with pytest.raises(DataError, match="does not exist; pass --fit"):
        art.read_prototypes(tmp_path / "none.npz")
    np.savez(tmp_path / "m.npz", classes=np.arange(2), prototypes=np.zeros((2, 4)), metric=np.array("manhattan"))
    with pytest.raises(DataError, match="metric 'manhattan' is not one of l2, cosine"):
        art.read_prototypes(tmp_path / "m.npz")


def test_model_file_keeps_state_and_spec_and_refuses_a_newer_format(tmp_path: Path) -> None:
    state = {"head.weight": np.ones((2, 3), np.float32), "backbone.bn.num_batches_tracked": np.array(7)}
    path = art.write_model(tmp_path / "model.npz", state, {"arch": "mlp", "in_shape": [1, 8, 8]})
    got, spec = art.read_model(path)
    assert spec["arch"] == "mlp" and spec["format"] == art.FORMAT and spec["version"] == art.VERSION
    assert set(got) == set(state) and int(got["backbone.bn.num_batches_tracked"]) == 7
    np.savez(tmp_path / "new.npz", spec=np.array(json.dumps({"format": art.FORMAT, "version": art.VERSION + 1})))
    with pytest.raises(DataError, match="version 2; this protofl-edge reads"):
        art.read_model(tmp_path / "new.npz")
    np.savez(tmp_path / "plain.npz", x=np.zeros(3))
    with pytest.raises(DataError, match="not a protofl model file"):
        art.read_model(tmp_path / "plain.npz")


def test_resolve_names_a_device_a_run_or_its_global_state(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for cid in ("a", "b"):
        d = art.device_dir(run, cid)
        art.write_model(d / art.MODEL, {}, {"arch": "mlp"})
        art.write_json(d / art.DEVICE, art.stamp(client_id=cid))
    with pytest.raises(DataError, match=r"holds device artifacts only: name one with --device \(a, b\)"):
        art.resolve(run)
    assert art.resolve(run, "b").kind == "device" and art.resolve(run, "b").info["client_id"] == "b"
    assert art.resolve(art.device_dir(run, "a")).path.name == "a"
    art.write_json(run / art.MANIFEST, art.stamp(fed="f", class_names=["x", "y"]))
    glob = art.resolve(run)
    assert glob.kind == "global" and glob.path == run / art.GLOBAL and glob.class_names == ["x", "y"]
    assert art.resolve(run / art.GLOBAL).kind == "global"
    with pytest.raises(DataError, match="does not exist; a run writes them"):
        art.resolve(tmp_path / "nowhere")
    with pytest.raises(DataError, match="is not a protofl artifact folder"):
        art.resolve(tmp_path)


@pytest.mark.parametrize(
    "preset, overrides, kind, reason",
    [
        ("fedavg", {}, "model", "aggregated model"),
        ("refprotofl", {"backbone": "frozen"}, "adapter", "shared frozen backbone"),
        ("refprotofl", {}, None, "every device trains its own backbone (backbone=train)"),
        ("refprotofl", {"backbone": "frozen", "archs": ("cnn", "mlp")}, None, "different architectures"),
        ("fedproto", {}, None, "only prototypes are federated"),
        ("protofl", {}, "head", "a global head solved from the devices' statistics (ridge)"),
        ("protofl", {"ridge": False}, None, "nearest global prototype on its own backbone"),
    ],
)
def test_a_global_predictor_where_the_config_defines_one(
    preset: str, overrides: dict, kind: str | None, reason: str
) -> None:
    got_kind, got_reason = art.predictor_kind(make_config(preset, **overrides))
    assert got_kind == kind and reason in got_reason


def test_class_names_come_from_the_data(tmp_path: Path) -> None:
    assert class_names("fashion-mnist", 10) == list(FASHION_MNIST_CLASSES)
    for name in ("cat", "dog"):
        (tmp_path / "pets" / name).mkdir(parents=True)
    assert class_names(f"imagefolder:{tmp_path / 'pets'}", 3) == ["cat", "dog", "2"]
    np.savez(tmp_path / "d.npz", x=np.zeros((2, 4, 4)), y=np.zeros(2, int), class_names=np.array(["no", "yes"]))
    assert class_names(f"npz:{tmp_path / 'd.npz'}", 2) == ["no", "yes"]
    assert class_names("synthetic", 3) == ["0", "1", "2"] and class_names(None, 1) == ["0"]


def test_data_to_label_from_npz_image_folder_and_csv(tmp_path: Path) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (5, 8, 8)).astype(np.uint8)
    np.savez(tmp_path / "u.npz", x=x)  # no labels
    got = load_unlabelled(f"npz:{tmp_path / 'u.npz'}", (1, 8, 8))
    assert got.names == ["0", "1", "2", "3", "4"] and np.array_equal(got.x[:, 0], x)
    assert np.allclose(got.normalized((0.5,), (0.5,))[0, 0], (x[0] / 255 - 0.5) / 0.5, atol=1e-6)  # float32
    for i in range(3):  # nested folders: names are the paths under the folder
        sub = tmp_path / "imgs" / ("a" if i < 2 else "b")
        sub.mkdir(parents=True, exist_ok=True)
        Image.fromarray(x[i]).save(sub / f"{i}.png")
    got = load_unlabelled(str(tmp_path / "imgs"), (1, 8, 8))
    assert got.names == ["a/0.png", "a/1.png", "b/2.png"] and np.array_equal(got.x[:, 0], x[:3])
    assert load_unlabelled(str(tmp_path / "imgs" / "b" / "2.png"), (1, 8, 8)).names == ["2.png"]
    rows = ["id," + ",".join(f"p{i}" for i in range(4))] + [
        f"s{i}," + ",".join(str(v) for v in x[i, 0, :4]) for i in range(2)
    ]
    (tmp_path / "u.csv").write_text("\n".join(rows) + "\n")
    got = load_unlabelled(f"csv:{tmp_path / 'u.csv'},name=id", (1, 2, 2))
    assert got.names == ["s0", "s1"] and np.array_equal(got.x.reshape(2, 4), x[:2, 0, :4])
    with pytest.raises(DataError, match=r"images are \(1, 8, 8\) .* but the model takes \(1, 28, 28\)"):
        load_unlabelled(f"npz:{tmp_path / 'u.npz'}", (1, 28, 28))
    with pytest.raises(DataError, match="not found; give npz:PATH"):
        load_unlabelled(str(tmp_path / "missing"), (1, 8, 8))
