"""A lite device (issue 57): `protofl-edge join` where torch cannot be imported, in a real federation.

`protofl-server start` (Mosquitto, the default preset: its ridge predictor, the backbone trained on the public set in
the server's torch child process, which also ships the backbone's ONNX graph) with one lite `join` (a process whose
imports of torch fail, and that never imported it when it returns) and one torch `join` on the same images
(`--partition 0/2` both): the run's summed ridge statistics equal those of the same federation with two torch devices
on those images, which holds only where the lite device's statistics equal the torch device's (float32 tolerance),
and so does its global predictor (the head solved from them).
Refusals: a preset that trains everywhere refuses a lite device at its join, the device says why and exits 2, and the
server logs it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from broker_server.ops.broker import free_port
from protofl import artifacts as art
from tests.conftest import EVENT_WAIT_S
from tests.test_packaging import BLOCKER, CLI_MODULES, REPO, RUN_CLI

pytestmark = [pytest.mark.slow, pytest.mark.mosquitto]

DATA = "synthetic:n=600,n_test=100"
ENV = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")


def start(port: int, state: Path, *args: str) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "broker_server.cli", "start", "--local-broker", "mosquitto", "--insecure",
            "--port", str(port), "--fed", "lite", "--rounds", "1", "--min-clients", "2", "--round-timeout", "120",
            "--state-dir", str(state), *args]  # fmt: skip
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV, text=True)


def join(port: int, client_id: str, *, lite: bool, data: tuple[str, ...]) -> subprocess.Popen[str]:
    args = ["join", "--broker", f"mqtt://127.0.0.1:{port}", "--fed", "lite", "--client-id", client_id, *data,
            "--threads", "1", "--connect-timeout", str(int(EVENT_WAIT_S))]  # fmt: skip
    # (the broker comes up only once the server's child process has trained the backbone: a minute when loaded)
    if lite:  # torch unimportable: `join` takes the lite path by itself (no --lite)
        argv = [sys.executable, "-c", BLOCKER + RUN_CLI, CLI_MODULES["protofl-edge"], "protofl-edge", *args]
        env = dict(ENV, BLOCKED="torch,torchvision,onnxscript")
    else:
        argv, env = [sys.executable, "-m", "edge_agent.cli", *args], ENV
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)


def federation(tmp: Path, lite: tuple[bool, bool], *server_args: str) -> tuple[int | None, str, list[tuple[int, str]]]:
    """`start` and two devices on the same images (lite or torch each): (server code, its output, [(code, output)])."""
    port = free_port()
    server = start(port, tmp / "server", *server_args)
    same = ("--data", DATA, "--partition", "0/2")
    devices = [join(port, f"dev-{i}", lite=is_lite, data=same) for i, is_lite in enumerate(lite)]
    end = time.monotonic() + EVENT_WAIT_S
    try:
        while time.monotonic() < end and any(d.poll() is None for d in devices):
            if any(d.poll() not in (None, 0) for d in devices):
                break  # one failed: the others would wait for it
            time.sleep(0.5)
        for d in devices:
            if d.poll() is None:
                d.kill()
        outs = [d.communicate(timeout=60)[0] for d in devices]
        if any(d.returncode != 0 for d in devices):
            server.kill()
        out, _ = server.communicate(timeout=EVENT_WAIT_S)
    finally:
        for p in (server, *devices):
            if p.poll() is None:
                p.kill()
    return server.returncode, out, [(d.returncode, o) for d, o in zip(devices, outs, strict=True)]


RIDGE = ("--public-data", DATA, "--set", "backbone_epochs=2")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for name, kinds in (("mixed", (True, False)), ("torch", (False, False))):
        tmp = tmp_path_factory.mktemp(name)
        code, log, devices = federation(tmp, kinds, *RIDGE)
        assert code == 0, log
        assert all(c == 0 for c, _ in devices), devices
        out[name] = tmp
        out[name + "-log"] = log  # type: ignore[assignment]
        out[name + "-devices"] = devices  # type: ignore[assignment]
    return out


def test_a_lite_device_serves_the_ridge_predictor_as_a_torch_device_does(runs: dict[str, Path]) -> None:
    lite_out = runs["mixed-devices"][0][1]  # type: ignore[index]
    assert "joining as a lite device" in lite_out and "Traceback" not in lite_out, lite_out
    w, b, backbone, info = art.read_predictor(runs["mixed"] / "server" / "artifacts" / "global" / art.PREDICTOR)
    w0, b0, backbone0, info0 = art.read_predictor(runs["torch"] / "server" / "artifacts" / "global" / art.PREDICTOR)
    assert info["devices"] == info0["devices"] == 2, (info, info0)
    assert backbone is not None and backbone0 is not None and np.array_equal(backbone, backbone0)
    # The summed statistics (the server model's): lite + torch against torch + torch, so the lite device's (onnxruntime)
    # are the torch device's (torch) within float32 rounding (the sums are float64 of float32 uploads).
    mixed = np.load(runs["mixed"] / "server" / "server_model.npz")["stats"]
    torch_only = np.load(runs["torch"] / "server" / "server_model.npz")["stats"]
    scale = float(np.abs(torch_only).max())
    assert scale > 0
    np.testing.assert_allclose(mixed, torch_only, rtol=1e-5, atol=1e-7 * scale)
    # The predictor: the same head, up to what the solve makes of those rounding differences (G is singular here, 138
    # samples for 513 features: lambda alone conditions it, so 1e-8 in G moves the head by ~1e-3 of its scale).
    np.testing.assert_allclose(w, w0, rtol=0, atol=1e-2 * float(np.abs(w0).max()))
    np.testing.assert_allclose(b, b0, rtol=0, atol=1e-2 * float(np.abs(b0).max()))
    assert not np.array_equal(w, np.zeros_like(w))


def test_a_preset_that_trains_everywhere_refuses_a_lite_device(tmp_path: Path) -> None:
    port = free_port()
    server = start(port, tmp_path / "server", "--preset", "fedproto", "--set", "in_shape=1,28,28")
    lines: list[str] = []
    said = threading.Event()

    def read() -> None:
        assert server.stdout is not None
        for line in server.stdout:
            lines.append(line)
            if "pi-zero" in line and "cannot join federation 'lite'" in line:
                said.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    device = join(port, "pi-zero", lite=True, data=("--data", DATA))
    try:
        out, _ = device.communicate(timeout=EVENT_WAIT_S)
        assert said.wait(EVENT_WAIT_S), "".join(lines)  # the server's log says who and why
    finally:
        for p in (device, server):
            if p.poll() is None:
                p.terminate()
        server.wait(60)
    assert device.returncode == 2, out
    assert "this lite device cannot join federation 'lite': preset 'fedproto' trains the model on every device" in out
    assert "Traceback" not in out
