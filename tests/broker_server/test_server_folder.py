"""Issue 56: the server's own folder used as a user expects, FedAvg scored with --validation, and a federation
that is not learning saying so in the log, `protofl-server status` and `protofl-server report`.

`protofl-server start --preset fedavg --public-data imagefolder:server --validation imagefolder:server` with the
README's small server folder (20 images a class): a stratified fifth of each class is held out for validation, said
with the sizes at INFO; FedAvg's global model is scored every round on it (rounds.jsonl); its exported model records
the input normalisation. The devices train at lr 1e-9, so the federation cannot learn: the log warns once, status and
the report say it. Two `protofl-edge join` processes over the server's own Mosquitto; 3 classes of 16x16 images.
"""

from __future__ import annotations

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
from broker_server.commands.start_cli import _federation
from broker_server.ops.broker import free_port
from protofl import artifacts as art
from protofl.data.federation import stratified_holdout
from tests.conftest import EVENT_WAIT_S

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
runner = CliRunner()


def folder(root: Path, per_class: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    for k, name in enumerate(["ant", "bee", "cat"]):
        (root / name).mkdir(parents=True)
        colour = np.array([k * 80, 255 - k * 80, 100])
        for i in range(per_class):
            img = np.clip(colour + rng.integers(-60, 60, (16, 16, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(img, "RGB").save(root / name / f"{i}.png")
    return root


def test_a_stratified_holdout_takes_its_share_of_every_class() -> None:
    y = np.repeat([0, 1, 2], [20, 10, 3])
    kept, held = stratified_holdout(y, 0.2, seed=0)
    assert np.bincount(y[held]).tolist() == [4, 2, 1]  # 20 %: 4 of 20, 2 of 10, round(0.6) = 1 of 3
    assert len(np.intersect1d(kept, held)) == 0 and len(kept) + len(held) == len(y)


def test_the_same_folder_at_share_0_is_all_for_the_backbone_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = f"imagefolder:{folder(tmp_path / 'server', 20, 0)}"
    caplog.set_level(logging.INFO)
    cfg, _, _, backbone, norm = _federation(
        "protofl", None, {"backbone_epochs": 1}, 1, 1, None, 0, data, None, data, None, None, 0.0
    )
    assert backbone is not None  # (trained once the broker is up: run here)
    public, scored = backbone()
    # all 60 images train the backbone (the public set), and validation scores those same 60
    assert cfg.public_per_class == 20 and public is not None and public.backbone is not None
    assert scored is not None and len(scored.labels) == 60
    assert "validation scores those same images, so its accuracy is optimistic" in caplog.text
    assert norm is not None and len(norm[0]) == 3


@pytest.mark.slow
def test_fedavg_on_the_server_folder_is_scored_and_says_it_is_not_learning(tmp_path: Path) -> None:
    server_dir = folder(tmp_path / "server", 20, 0)
    port = free_port()
    argv = [sys.executable, "-m", "broker_server.cli", "start", "--preset", "fedavg", "--insecure",
            "--port", str(port), "--fed", "trial", "--public-data", f"imagefolder:{server_dir}",
            "--validation", f"imagefolder:{server_dir}", "--rounds", "4", "--min-clients", "2",
            "--round-timeout", "120", "--set", "lr=1e-9", "--state-dir", str(tmp_path / "state")]  # fmt: skip
    server = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV, text=True)
    devices = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "edge_agent.cli",
                "join",
                "--broker",
                f"mqtt://127.0.0.1:{port}",
                "--fed",
                "trial",
                "--client-id",
                f"dev-{i}",
                "--data",
                f"imagefolder:{folder(tmp_path / f'dev-{i}', 30, i + 1)}",
                "--threads",
                "1",
                "--connect-timeout",
                "120",
            ],  # fmt: skip
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=ENV,
            text=True,
        )
        for i in range(2)
    ]
    try:
        out, _ = server.communicate(timeout=EVENT_WAIT_S * 2)
        dev_out = [d.communicate(timeout=EVENT_WAIT_S)[0] for d in devices]
    finally:
        for p in (server, *devices):
            if p.poll() is None:
                p.kill()
    assert server.returncode == 0, out
    assert all(d.returncode == 0 for d in devices), dev_out
    said = " ".join(out.split())
    # the split, said with its sizes: 4 of each class's 20 for validation, the other 48 for the public data
    assert "a stratified 20 % of each class held out for validation (12 images, 4-4 a class), the other 48" in said
    rows = [json.loads(line) for line in (tmp_path / "state" / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    assert all(isinstance(r["predictor_acc"], float) for r in rows), rows  # FedAvg's global model, every round
    assert said.count("the federation is round 4: not learning") == 1, said  # once, with what to do
    assert "raise lr" in said
    status = runner.invoke(app, ["status", "--state-dir", str(tmp_path / "state")])
    assert status.exit_code == 0, status.output
    assert "WARNING: the federation is round 4: not learning" in " ".join(status.output.split()), status.output
    manifest = art.read_json(tmp_path / "state" / "artifacts" / art.MANIFEST)
    assert manifest["federated"] == "model" and len(manifest["norm_mean"]) == 3 and len(manifest["norm_std"]) == 3
    rep = runner.invoke(app, ["report", str(tmp_path / "state" / "rounds.jsonl"), "--out", str(tmp_path / "rep")])
    assert rep.exit_code == 0, rep.output
    assert "**Warning (fedavg):** the federation is not learning" in (tmp_path / "rep" / "summary.md").read_text()
