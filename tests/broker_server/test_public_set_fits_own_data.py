"""Issue 42: a public set is drawn only where an active technique uses one, and fits small own data.

`simulate --preset fedproto --dataset imagefolder:DIR --arch mymodels:tiny` on 3 class folders of 24 images failed
with "public set: class 0 has 19 samples, fewer than the 20 per class asked", although FedProto uses no public set.
Data with enough of every class (Fashion-MNIST) keeps today's public set for every preset, so methods compared on it
hold the same client data (test_simulate.py's test_partition_is_identical_across_presets, the goldens)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from broker_server.cli import app
from broker_server.commands.start_cli import _federation
from broker_server.simulation import SimulationSpec, prepare
from edge_agent.training import models
from protofl.data.dataset import Dataset
from protofl.data.federation import fit_public, public_size
from protofl.errors import DataError
from protofl.presets import make_config

runner = CliRunner()

FACTORY = '''import torch.nn as nn


def tiny(shape):
    """A backbone with 4-D output: (n, 4, 2, 2), flattened to 16 features."""
    return nn.Sequential(nn.Conv2d(shape[0], 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2))
'''


def folders(root: Path, per_class: int = 24) -> Path:
    """3 class folders of `per_class` 16x16 RGB PNGs, written with Pillow."""
    rng = np.random.default_rng(0)
    for k, name in enumerate(["ant", "bee", "cat"]):
        (root / name).mkdir(parents=True)
        colour = np.array([k * 80, 255 - k * 80, 100])
        for i in range(per_class):
            img = np.clip(colour + rng.integers(-30, 30, (16, 16, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(img, "RGB").save(root / name / f"{i}.png")
    return root


@pytest.fixture
def own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The issue's setup: image folders and an own model factory `mymodels:tiny` on the path."""
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "mymodels.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    return folders(tmp_path / "imgs")


def simulate(imgs: Path, out: Path, *extra: str) -> tuple[int, str]:
    args = ["simulate", "--dataset", f"imagefolder:{imgs}", "--arch", "mymodels:tiny", "--clients", "2"]
    res = runner.invoke(app, [*args, "--rounds", "1", "--json", str(out), *extra])
    return res.exit_code, " ".join(res.output.split())


def public_per_class(imgs: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, *extra: str) -> int:
    """Simulate one round (it must succeed, logging at INFO into `caplog`): the public_per_class it ran with."""
    caplog.set_level(logging.INFO)
    code, out = simulate(imgs, tmp_path / "r.json", *extra)
    assert code == 0, out
    return int(json.loads((tmp_path / "r.json").read_text())["config"]["public_per_class"])


def test_fedproto_on_small_own_data_draws_no_public_set(own: Path, tmp_path: Path, caplog) -> None:
    assert public_per_class(own, tmp_path, caplog, "--preset", "fedproto") == 0
    assert "no public set: preset 'fedproto' uses none" in caplog.text
    # ... and its clients hold every training sample
    fed = prepare(SimulationSpec(preset="fedproto", dataset=f"imagefolder:{own}", clients=2, archs=("mymodels:tiny",)))
    assert len(fed.split.public) == 0
    held = np.concatenate([np.concatenate([c.train, c.test]) for c in fed.split.clients])
    assert sorted(held.tolist()) == list(range(len(fed.train.y)))


def test_a_backbone_with_4d_output_says_its_measured_feature_width_once(
    own: Path, tmp_path: Path, caplog, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(models, "_FLATTENED", set())  # said once a process: this one may have said it already
    public_per_class(own, tmp_path, caplog, "--preset", "fedproto")
    said = [r.getMessage() for r in caplog.records if "flattened" in r.getMessage()]
    # once, although every device (and the server's view of the model) builds it
    assert said == [
        "architecture 'mymodels:tiny': the backbone's output per sample, 4x2x2, is flattened to 16 features "
        "(the feature width)"
    ], said


def test_protofl_fits_its_public_set_to_small_own_data(own: Path, tmp_path: Path, caplog) -> None:
    # The default preset uses the public set (the ridge predictor's shared backbone): a quarter of the smallest class.
    assert public_per_class(own, tmp_path, caplog, "--set", "backbone_epochs=1") == 4
    assert "public set: 4 per class (a quarter of class 0's 19 samples" in caplog.text


def test_a_public_set_the_data_cannot_give_names_the_option_to_set(own: Path, tmp_path: Path) -> None:
    # asked for explicitly: refused, with the size that fits and the switch that runs without it
    code, out = simulate(own, tmp_path / "r.json", "--set", "public_per_class=20")
    assert code == 2
    assert "class 0 has 19 samples, fewer than the 20 per class asked" in out, out
    assert "--set public_per_class=4" in out and "--set ridge=false" in out, out
    code, out = simulate(own, tmp_path / "r.json", "--preset", "refprotofl", "--set", "public_per_class=20")
    assert code == 2 and "--set public_per_class=4" in out and "--set erpa=false" in out, out
    # too few for even one a class while the clients keep three quarters: the switch
    code, out = simulate(folders(tmp_path / "few", per_class=4), tmp_path / "r.json")
    assert code == 2 and "--set ridge=false" in out and "public_per_class=" not in out.split("asked")[1], out


def test_start_draws_the_public_set_only_where_it_is_used(own: Path) -> None:
    data = f"imagefolder:{own}"
    cfg, public, _, _, _ = _federation("fedproto", None, {}, 1, 1, None, 0, data, None)
    # the whole folder (24 a class, no longer an 80 % holdout of 19) has public_per_class 20; fedproto sends none
    assert cfg.public_per_class == 20 and public is None
    # the server's whole folder (issue 56: it took a quarter of an 80 % holdout, 4 a class): 20 of each class's 24
    cfg, public, _, _, _ = _federation("refprotofl", None, {}, 1, 1, None, 0, data, None)
    assert cfg.public_per_class == 20 and public is not None and len(public.y) == 60


def test_data_with_enough_of_every_class_keeps_the_public_set_for_every_preset() -> None:
    # Fashion-MNIST's partitions do not change: the public set is carved whatever the preset, where it fits.
    y = np.repeat(np.arange(10), 30)
    train = Dataset(x=np.zeros((len(y), 1, 2, 2), np.uint8), y=y, num_classes=10, name="t", mean=(0.5,), std=(0.5,))
    for preset in ("fedavg", "fedproto", "protofl", "refprotofl"):
        cfg = make_config(preset, num_classes=10, in_shape=(1, 2, 2))
        assert public_size(y, cfg) == 20 and fit_public(train, cfg, fixed=False) is cfg, preset
    small = make_config("protofl", num_classes=10, in_shape=(1, 2, 2), public_per_class=31)
    with pytest.raises(DataError, match="ridge=false"):
        public_size(y, small)
