"""An own model from outside the package (tests/external_model: `tiny_backbone.nets:make`, registered as the
`protofl.models` entry point `tinynet`) runs through `simulate`, through `join` over MQTT, and exports to ONNX;
no file of the package changes for it. A factory that does not fit is a ConfigError saying what was wrong."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

EXTERNAL = Path(__file__).parent / "external_model"
DATASET = "synthetic:n=600,n_test=200"
ACCEPTED = r"known: cnn, .*package\.module:factory.*entry-point group protofl\.models"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(EXTERNAL), os.environ.get("PYTHONPATH")]))}


def _run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), env=_env(), capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch, one_torch_thread: None) -> Iterator[None]:
    """The package on the path, as if pip-installed: its entry point is found by importlib.metadata."""
    monkeypatch.syspath_prepend(str(EXTERNAL))
    yield
    for name in [m for m in sys.modules if m.split(".")[0] == "tiny_backbone"]:
        del sys.modules[name]


# -- factories that do not fit (referred to as f"{__name__}:name") ----------------------------------------

NOT_CALLABLE = 3


def returns_a_list(in_shape: tuple[int, int, int]) -> list[int]:
    return [1, 2]


def returns_a_vector(in_shape: tuple[int, int, int]) -> object:
    import torch

    class Sum(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.sum()  # a scalar, not (n, d)

    return Sum()


def raises(in_shape: tuple[int, int, int]) -> object:
    raise ValueError("needs 3 channels")


# -- the model -----------------------------------------------------------------------------------------------


def test_entry_point_and_module_factory_build_the_same_seeded_model(installed: None) -> None:
    import torch
    from torch import nn

    from edge_agent.training.models import available_architectures, build_model

    assert available_architectures()[-1] == "tinynet"
    a = build_model("tinynet", (1, 28, 28), 10, seed=4)
    b = build_model("tiny_backbone.nets:make", (1, 28, 28), 10, seed=4)
    assert (a.arch, b.arch) == ("tinynet", "tiny_backbone.nets:make")
    # (n, 8, 2, 2) flattened: d = 32 found by the dry pass; the stem maps it to m as for a built-in
    assert a.backbone_dim == 32 and isinstance(a.stem, nn.Linear) and a.stem.in_features == 32
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    # the dry pass moved no BatchNorm statistics and left every module in training mode
    bn = a.backbone.get_submodule("net.1")
    assert isinstance(bn, nn.BatchNorm2d) and bn.running_mean is not None and bn.num_batches_tracked is not None
    assert torch.equal(bn.running_mean, torch.zeros(8)) and int(bn.num_batches_tracked) == 0
    assert all(m.training for m in a.modules())
    assert a(torch.randn(3, 1, 28, 28)).shape == (3, 10)
    proj = build_model("tinynet", (3, 32, 32), 7, proto_dim=32, projection=True, seed=0)
    assert isinstance(proj.stem, nn.Identity) and proj.projection is not None  # d == m: no stem, as for built-ins


@pytest.mark.parametrize(
    "arch, problem",
    [
        ("vgg99", r"unknown architecture 'vgg99'; "),
        ("nope.module:make", r"cannot load nope.module:make \(ModuleNotFoundError"),
        ("tiny_backbone.nets:missing", r"has no attribute 'missing'"),
        (f"{__name__}:NOT_CALLABLE", r"is a int, not callable; "),
        (f"{__name__}:returns_a_list", r"the factory returned list, not a torch.nn.Module; "),
        (f"{__name__}:returns_a_vector", r"maps a \(2, 1, 28, 28\) batch to \(\), expected a tensor \(2, d\)"),
        (f"{__name__}:raises", r"the factory failed for input shape \(1, 28, 28\): ValueError: needs 3 channels"),
        ("mymodel.py:Net", r"name the module, not the file: mymodel:Net with its folder on PYTHONPATH"),
    ],
)
def test_a_factory_that_does_not_fit_says_what_was_wrong(installed: None, arch: str, problem: str) -> None:
    from edge_agent.training.models import build_model
    from protofl.errors import ConfigError

    with pytest.raises(ConfigError, match=problem) as err:
        build_model(arch, (1, 28, 28), 10)
    if "name the module" not in problem:
        assert "a factory takes the input shape (channels, height, width)" in str(err.value)


def test_without_the_package_tinynet_is_unknown() -> None:
    from edge_agent.training.models import available_architectures, build_model
    from protofl.errors import ConfigError

    assert "tinynet" not in available_architectures()
    with pytest.raises(ConfigError, match=rf"unknown architecture 'tinynet'; {ACCEPTED} \(none installed\)"):
        build_model("tinynet", (1, 28, 28), 10)


def test_models_lists_the_installed_model() -> None:
    proc = _run("protofl-edge", "models", timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = next(line for line in proc.stdout.splitlines() if "tinynet" in line)
    assert "32" in row.split()  # backbone d


# -- through the federation -------------------------------------------------------------------------------


@pytest.mark.slow
def test_simulate_mixes_built_in_entry_point_and_module_factory(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    proc = _run(
        "protofl-server",
        "simulate",
        "--preset",
        "fedproto",
        "--dataset",
        DATASET,
        "--clients",
        "3",
        "--rounds",
        "2",
        "--arch",
        "cnn,tinynet,tiny_backbone.nets:make",
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(out.read_text())
    assert run["config"]["archs"] == ["cnn", "tinynet", "tiny_backbone.nets:make"]
    assert not run.get("dropped") and [r["clients"] for r in run["rounds"]] == [3, 3]
    assert run["rounds"][-1]["global_proto_acc"] is not None


@pytest.mark.slow
def test_join_processes_run_own_models_over_mqtt(tmp_path: Path) -> None:
    # simulate --transport mqtt starts mosquitto and one `protofl-edge join` process per device; the devices
    # extract prototypes with onnxruntime from the own model re-exported each round
    out = tmp_path / "run.json"
    proc = _run(
        "protofl-server",
        "simulate",
        "--transport",
        "mqtt",
        "--preset",
        "tinyproto",
        "--dataset",
        DATASET,
        "--clients",
        "2",
        "--rounds",
        "2",
        "--arch",
        "tinynet,tiny_backbone.nets:make",
        "--extractor",
        "onnx",
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(out.read_text())
    assert run["simulation"]["transport"] == "mqtt" and run["dropped"] == {}
    assert [r["clients"] for r in run["rounds"]] == [2, 2] and run["rounds"][-1]["local_acc"] is not None


@pytest.mark.slow
def test_a_device_whose_factory_fails_exits_instead_of_waiting() -> None:
    # the factory imports (join's early check passes) but returns no nn.Module: the join process stops with the
    # reason as soon as the config comes, and simulate reports the agent's exit
    proc = _run(
        "protofl-server",
        "simulate",
        "--transport",
        "mqtt",
        "--dataset",
        DATASET,
        "--clients",
        "2",
        "--rounds",
        "1",
        "--arch",
        f"cnn,{__name__}:returns_a_list",
        timeout=300,
    )
    assert proc.returncode != 0
    assert "the factory returned list, not a torch.nn.Module" in " ".join(proc.stderr.split())


def test_join_refuses_an_arch_that_names_no_model_before_connecting() -> None:
    # port 1: nothing listens there; the arch is checked first
    proc = _run(
        "protofl-edge",
        "join",
        "--broker",
        "mqtt://127.0.0.1:1",
        "--fed",
        "f",
        "--client-id",
        "d1",
        "--data",
        "synthetic",
        "--arch",
        "tiny_backbone.nets:nothing",
        timeout=120,
    )
    assert proc.returncode == 2 and "has no attribute 'nothing'" in " ".join(proc.stderr.split())


def test_simulate_refuses_a_factory_that_cannot_be_imported() -> None:
    proc = _run(
        "protofl-server",
        "simulate",
        "--dataset",
        DATASET,
        "--clients",
        "2",
        "--rounds",
        "1",
        "--arch",
        "cnn,no_such_pkg.nets:make",
        timeout=120,
    )
    assert proc.returncode == 2
    assert "architecture 'no_such_pkg.nets:make': cannot load" in " ".join(proc.stderr.split())


# -- ONNX -------------------------------------------------------------------------------------------------------


def test_onnx_extractor_matches_torch(installed: None) -> None:
    import torch

    from edge_agent.inference.extractor import OnnxExtractor, TorchExtractor
    from edge_agent.training.models import build_model

    model = build_model("tinynet", (1, 28, 28), 10, seed=1)
    x = np.random.default_rng(0).standard_normal((40, 1, 28, 28)).astype(np.float32)
    model.train()
    model(torch.from_numpy(x))  # BatchNorm statistics that are not the defaults
    o, t = OnnxExtractor(model), TorchExtractor(model)
    assert np.abs(o.embed(x) - t.embed(x)).max() < 1e-4
    assert np.abs(o.predict_proba(x) - t.predict_proba(x)).max() < 1e-4


def test_export_rebuilds_the_own_model_from_its_checkpoint(installed: None, tmp_path: Path) -> None:
    import torch

    from edge_agent.training.models import build_model
    from export.checkpoint import load_checkpoint, save_checkpoint

    model = build_model("tiny_backbone.nets:make", (1, 28, 28), 10, seed=1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # trained weights, not the seeded ones
    ckpt = save_checkpoint(model, tmp_path / "tiny.pt")
    assert load_checkpoint(ckpt)[1]["arch"] == "tiny_backbone.nets:make"
    rng = np.random.default_rng(1)
    data = tmp_path / "data.npz"
    np.savez(
        data,
        x=rng.integers(0, 256, (64, 28, 28), dtype=np.uint8),
        y=rng.integers(0, 10, 64),
        x_test=rng.integers(0, 256, (64, 28, 28), dtype=np.uint8),
        y_test=rng.integers(0, 10, 64),
    )
    onnx_path = tmp_path / "tiny.onnx"
    proc = _run("protofl-export", "onnx", "--checkpoint", str(ckpt), "--out", str(onnx_path), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    assert "tiny_backbone.nets:make features, input (batch,1,28,28) -> (batch,512)" in proc.stdout
    proc = _run(
        "protofl-export",
        "verify",
        str(onnx_path),
        "--checkpoint",
        str(ckpt),
        "--data",
        f"npz:{data}",
        "--n",
        "64",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
