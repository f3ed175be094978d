"""Checkpoints: weights_only round trip, a description beside the weights, refusal of pickled objects."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from edge_agent.training.models import build_model
from export.checkpoint import load_checkpoint, load_model, save_checkpoint
from protofl.errors import ConfigError


def test_round_trip_rebuilds_the_same_model(tmp_path: Path) -> None:
    model = build_model("mlp", (1, 20, 20), 7, proto_dim=64, seed=3)
    with torch.no_grad():
        model.head.bias.add_(1.0)  # not the seeded initial weights any more
    path = save_checkpoint(model, tmp_path / "m.pt", mean=(0.5,), std=(0.25,))
    _, meta = load_checkpoint(path)
    assert meta["arch"] == "mlp" and meta["in_shape"] == [1, 20, 20] and meta["num_classes"] == 7
    assert meta["norm_mean"] == [0.5] and meta["norm_std"] == [0.25]
    loaded = load_model(None, path)  # everything comes from the checkpoint
    assert loaded.arch == "mlp" and loaded.in_shape == (1, 20, 20) and loaded.proto_dim == 64
    for (k, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), k


def test_bare_state_dict_needs_the_description(tmp_path: Path) -> None:
    model = build_model("mlp", (1, 28, 28), 10, seed=0)
    path = tmp_path / "bare.pt"
    torch.save(model.state_dict(), path)
    with pytest.raises(ConfigError, match="bare state_dict: pass --arch"):
        load_model(None, path)
    assert load_model("mlp", path).arch == "mlp"
    with pytest.raises(ConfigError, match="does not fit a cnn model"):
        load_model("cnn", path)


def test_contradicting_arch_is_an_error(tmp_path: Path) -> None:
    path = save_checkpoint(build_model("mlp", (1, 28, 28), 10, seed=0), tmp_path / "m.pt")
    with pytest.raises(ConfigError, match="holds a 'mlp' model but --arch is 'cnn'"):
        load_model("cnn", path)


def test_pickled_modules_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "module.pt"
    torch.save(build_model("mlp", (1, 28, 28), 10, seed=0), path)  # a whole module: unpickling runs code
    with pytest.raises(ConfigError, match="cannot be loaded safely"):
        load_checkpoint(path)


def test_missing_checkpoint_and_no_arch(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_checkpoint(tmp_path / "nope.pt")
    with pytest.raises(ConfigError, match="say which architecture"):
        load_model(None, None)
    a, b = load_model("cnn", None, seed=4), load_model("cnn", None, seed=4)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))  # seeded initial weights


def test_a_federation_s_device_files_load_without_torch_load(tmp_path: Path) -> None:
    """A device's resume checkpoint (join --state-dir, msgpack) and its artifact model.npz load as checkpoints:
    neither is pickled, so neither goes through torch.load (whose weights_only advice would be wrong)."""
    from edge_agent.core.artifacts import model_spec
    from protofl import artifacts as art
    from protofl.checkpoint import write_checkpoint
    from protofl.presets import make_config

    model = build_model("mlp", (1, 8, 8), 3, proto_dim=16, adapter_rank=2, seed=1)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    cfg = make_config("fedproto", archs=("mlp",), in_shape=(1, 8, 8), num_classes=3, proto_dim=16, adapter_rank=2)
    write_checkpoint(tmp_path / "f-dev.ckpt", {"format": 2, "cfg": cfg.to_dict(), "model": state})
    art.write_model(tmp_path / "model.npz", state, model_spec(model, (0.5,), (0.25,)))
    for path in (tmp_path / "f-dev.ckpt", tmp_path / "model.npz"):
        loaded = load_model(None, path)
        assert loaded.arch == "mlp" and loaded.proto_dim == 16
        for (k, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
            assert torch.equal(a, b), (path.name, k)
    assert load_checkpoint(tmp_path / "model.npz")[1]["norm_mean"] == [0.5]
    write_checkpoint(tmp_path / "server.ckpt", {"machine": {}})
    with pytest.raises(ConfigError, match="not a device's .* --from STATE_DIR/artifacts"):
        load_model(None, tmp_path / "server.ckpt")
