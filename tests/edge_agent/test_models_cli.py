"""`protofl-edge models` through the command line: parameters, upload bytes per preset, measured memory, fit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from edge_agent.ops.model_sizes import FOOTPRINT, SENDER
from edge_agent.training.models import build_model
from edge_agent.training.params import count_parameters, full_vector
from protofl.profiles import load_device
from protofl.wire import ParamsUpload, ProtoSet, ProtoUpload, message_size

REPO = Path(__file__).resolve().parents[2]


def _models(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="240")
    return subprocess.run(
        [sys.executable, "-m", "edge_agent.cli", "models", *args], env=env, capture_output=True, text=True, timeout=300
    )


def _cells(out: str, *first: str) -> list[str]:
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("│┃ ").split("│")]
        if cells[: len(first)] == list(first):
            return cells
    raise AssertionError(f"no row {first} in:\n{out}")


def test_models_shows_params_real_upload_bytes_and_the_measured_peak() -> None:
    proc = _models("--archs", "cnn", "--presets", "fedavg,fedproto,tinyproto", "--profile", "rpi3")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    model = build_model("cnn", (1, 28, 28), 10, seed=0)
    assert _cells(proc.stdout, "cnn")[4] == f"{count_parameters(model):,}"
    # The real encoded uploads of a device holding 20 samples (the command's), sent as SENDER in round 2.
    env = {"fed": "sizes", "sender": SENDER, "round": 2, "phase": "train"}
    fedavg = message_size(ParamsUpload(update=full_vector(model), n_samples=20, base_round=2, dt="f4"), **env)
    assert fedavg > 4 * count_parameters(model)
    table = {c: np.ones(512, np.float32) for c in range(10)}
    fedproto = message_size(
        ProtoUpload(local=ProtoSet.from_table(table, 512, "f4", dict.fromkeys(table, 2)), public=None, n_samples=20),
        **env,
    )
    peaks = json.loads(FOOTPRINT.read_text())["peak_mb"]["cnn"]
    rpi3 = load_device("rpi3").memory_mb
    for preset, size in (("fedavg", fedavg), ("fedproto", fedproto)):
        row = _cells(proc.stdout, "cnn", preset)
        assert row[2].startswith(f"{size:,} B"), (preset, row)
        assert row[4] == f"{peaks[preset]:.0f} MB"
        assert row[5] == ("yes" if peaks[preset] <= rpi3 else "no")
    tiny = _cells(proc.stdout, "cnn", "tinyproto")  # CPS: s = m/10 values per class, and nothing measured
    assert int(tiny[2].split()[0].replace(",", "")) < fedproto / 5 and tiny[4] == "not measured" and tiny[5] == "?"
    assert "measured" in proc.stdout and "bench_footprint" in proc.stdout


def test_models_refuses_an_unknown_preset_and_profile_and_says_the_known_ones() -> None:
    proc = _models("--archs", "cnn", "--presets", "fedsgd")
    assert proc.returncode == 2 and "unknown preset(s) ['fedsgd']" in proc.stderr and "fedproto" in proc.stderr
    proc = _models("--archs", "cnn", "--profile", "pi-zero")
    assert proc.returncode == 2 and "pi-zero" in proc.stderr and "Traceback" not in proc.stderr
