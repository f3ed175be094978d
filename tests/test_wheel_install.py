"""A device installs from the project's wheel with the `device` extra alone, without a clone (issue 59, item 6).

The test builds the wheel as CI and the README do (`pip wheel --no-deps --no-build-isolation`), then installs
`protofl_edge-<ver>-py3-none-any.whl[device]` into a throwaway virtual environment under tmp with `--no-index
--find-links` (no network in a test): the packages the wheel may resolve against are exactly the requirement closure
of the base install plus `[device]` (numpy, paho-mqtt, ..., torch, Pillow and what they require), linked in from this
environment, nothing else. So the install succeeds only if `[device]` names everything a device needs, and the device
commands then run from the installed wheel (not this checkout), without onnxruntime, ray, mkdocs or pytest."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]


def closure(extras: set[str]) -> set[str]:
    """The distributions the base install plus `extras` requires, transitively (markers evaluated here)."""
    todo = [("protofl-edge", frozenset(extras))]
    seen: set[str] = set()
    while todo:
        name, wanted = todo.pop()
        for text in metadata.requires(name) or []:
            req = Requirement(text)
            env = [{"extra": e} for e in wanted] or [{"extra": ""}]
            if req.marker is not None and not any(req.marker.evaluate(e) for e in env):
                continue
            key = re.sub(r"[-_.]+", "-", req.name).lower()
            if key not in seen:
                seen.add(key)
                todo.append((req.name, frozenset(req.extras)))
    return seen


def link_site(dists: set[str], into: Path) -> None:
    """A site folder holding only `dists`: links to their top-level packages, modules and metadata."""
    into.mkdir(parents=True)
    for name in dists:
        dist = metadata.distribution(name)
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        root = Path(str(dist.locate_file("")))
        for top in tops:
            if (root / top).exists() and not (into / top).exists() and top != "__pycache__":
                (into / top).symlink_to(root / top)


@pytest.mark.slow
def test_a_device_installs_from_the_wheel_with_the_device_extra_alone(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(dist), "."],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = dist.glob("protofl_edge-*-py3-none-any.whl")
    deps = closure({"device"})
    assert {"torch", "pillow", "numpy", "paho-mqtt"} <= deps and not {"onnxruntime", "ray", "pytest"} & deps, deps
    link_site(deps, tmp_path / "deps")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "deps.pth").write_text(str(tmp_path / "deps") + "\n")
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_CONSTRAINT", "VIRTUAL_ENV")}
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index", "--find-links", str(dist)]
        + [f"{wheel}[device]"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    assert "Successfully installed protofl-edge" in install.stdout, install.stdout
    where = subprocess.run(
        [str(python), "-c", "import edge_agent, torch, PIL; print(edge_agent.__file__)"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert where.returncode == 0 and where.stdout.startswith(str(site)), where.stdout + where.stderr
    for args, said in ((["models"], "mlp"), (["join", "--help"], "--credentials"), (["profiles"], "rpi4")):
        done = subprocess.run(
            [str(venv / "bin" / "protofl-edge"), *args], capture_output=True, text=True, env=env, cwd=tmp_path
        )
        assert done.returncode == 0 and said in done.stdout, (args, done.stdout + done.stderr)
    absent = subprocess.run([str(python), "-c", "import onnxruntime"], capture_output=True, env=env, cwd=tmp_path)
    assert absent.returncode != 0  # the onnx extra was not asked for, and nothing pulled it in
