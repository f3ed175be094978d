"""The base install (no torch) serves the server side, and the device commands say what to install.

Each CLI runs in a subprocess whose import system refuses ``torch`` (as on a server box that installed
``protofl-edge`` without the ``device`` extra): the numpy-only commands work, and the commands that
need PyTorch exit 2 with the install hint instead of a traceback.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover (Python 3.10)
    import tomli as tomllib

import pytest

from protofl.errors import ConfigError
from protofl.requirements import TORCH_INSTALL_HINT, explain_missing, require_torch, torch_available

REPO = Path(__file__).resolve().parents[1]
HINT = "pip install 'protofl-edge[device]'"

# Refuses every module named in $BLOCKED (comma-separated; torch by default) and its submodules.
BLOCKER = textwrap.dedent(
    """
    import importlib, importlib.abc, os, sys

    BLOCKED = os.environ.get("BLOCKED", "torch").split(",")

    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            top = name.partition(".")[0]
            if top in BLOCKED:
                raise ImportError(f"{top} is blocked in this test (tried to import {name})", name=top)
            return None

    sys.meta_path.insert(0, Blocker())
    """
)

# Runs `app` of MODULE (a typer CLI, as its console script does).
RUN_CLI = BLOCKER + textwrap.dedent(
    """
    module, prog, *args = sys.argv[1:]
    app = importlib.import_module(module).app
    try:
        app(args, prog_name=prog)
    finally:
        assert not set(BLOCKED) & set(sys.modules), "a blocked module was imported"
    """
)

CLI_MODULES = {"protofl-server": "broker_server.cli", "protofl-edge": "edge_agent.cli", "protofl-export": "export.cli"}


def python_without_torch(code: str, *argv: str, blocked: str = "torch") -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "BLOCKED": blocked,
        "COLUMNS": "250",  # rich wraps help text at the terminal width
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.run(
        [sys.executable, "-c", code, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


def run_without_torch(cli: str, *args: str, blocked: str = "torch") -> subprocess.CompletedProcess[str]:
    return python_without_torch(RUN_CLI, CLI_MODULES[cli], cli, *args, blocked=blocked)


@pytest.mark.parametrize("args", [["--help"], ["start", "--help"], ["status", "--help"], ["presets"]], ids=" ".join)
def test_server_commands_run_without_torch(args: list[str]) -> None:
    proc = run_without_torch("protofl-server", *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr


def test_server_commands_without_their_extra_name_it_whole(tmp_path: Path) -> None:
    # rich read "[device]" and "[plotting]" in the hint as markup and printed "pip install 'protofl-edge'"
    proc = run_without_torch("protofl-server", "simulate", "--dataset", "synthetic:n=200,n_test=50", "--clients", "2")
    assert proc.returncode == 2 and "pip install 'protofl-edge[device]'" in proc.stdout + proc.stderr, proc.stdout
    run = tmp_path / "run.json"
    run.write_text('{"preset": "fedavg", "rounds": [], "totals": {}}')
    proc = run_without_torch("protofl-server", "report", str(run), "--out", str(tmp_path), blocked="torch,matplotlib")
    assert proc.returncode == 2 and "pip install 'protofl-edge[plotting]'" in proc.stdout + proc.stderr, proc.stdout


def test_edge_help_says_what_to_install() -> None:
    proc = run_without_torch("protofl-edge", "models", "--help")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "--profile" in proc.stdout and HINT in proc.stdout, proc.stdout
    # `join` runs without torch (a lite device, issue 57): its help says so, and nothing asks for torch
    proc = run_without_torch("protofl-edge", "join", "--help")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "--client-id" in proc.stdout and "--lite" in proc.stdout and HINT not in proc.stdout, proc.stdout
    assert run_without_torch("protofl-edge", "--help").returncode == 0
    version = run_without_torch("protofl-edge", "version")
    assert version.returncode == 0 and "protofl-edge" in version.stdout, version.stdout + version.stderr


def test_device_commands_without_torch_exit_2_with_the_hint() -> None:
    proc = run_without_torch("protofl-edge", "models")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "protofl-edge models needs PyTorch" in proc.stderr and HINT in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


JOIN = [
    "join",
    "--broker",
    "mqtt://127.0.0.1:1",
    "--client-id",
    "dev1",
    "--data",
    "synthetic",
    "--connect-timeout",
    "1",
]


def test_join_without_torch_is_a_lite_device() -> None:
    """Without torch `join` runs a lite device (onnxruntime: issue 57) as far as the broker; without onnxruntime
    either it says what to install; an option only a torch device has is refused, saying why."""
    proc = run_without_torch("protofl-edge", *JOIN)
    assert proc.returncode == 2 and "cannot reach broker at mqtt://127.0.0.1:1" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run_without_torch("protofl-edge", *JOIN, blocked="torch,onnxruntime")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "joins as a lite device, which needs onnxruntime: pip install 'protofl-edge[lite]'" in proc.stderr
    proc = run_without_torch("protofl-edge", *JOIN, "--arch", "mlp")
    assert proc.returncode == 2 and "torch is not installed here, so this device joins as a lite device" in proc.stderr
    assert "--arch is for a device that trains (torch)" in proc.stderr and HINT in proc.stderr, proc.stderr


def test_predict_needs_no_torch(tmp_path: Path) -> None:
    # `predict` runs on onnxruntime alone: without torch it gets as far as its own input checks.
    proc = run_without_torch(
        "protofl-edge", "predict", "--model", str(tmp_path / "absent.onnx"), "--prototypes", str(tmp_path / "p.npz")
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "absent.onnx does not exist" in proc.stderr and "PyTorch" not in proc.stderr, proc.stderr
    # ... and where the onnx extra is missing as well, it says so.
    proc = run_without_torch(
        "protofl-edge",
        "predict",
        "--model",
        str(tmp_path / "absent.onnx"),
        "--prototypes",
        str(tmp_path / "p.npz"),
        blocked="torch,onnx,onnxruntime",
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "protofl-edge predict needs onnx, which is not installed: pip install 'protofl-edge[onnx]'" in proc.stderr


def test_export_without_torch_says_what_to_install(tmp_path: Path) -> None:
    proc = run_without_torch("protofl-export", "onnx", "--arch", "mlp", "--out", str(tmp_path / "m.onnx"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"protofl-export onnx needs PyTorch, which is not installed: {HINT}" in proc.stderr, proc.stderr


def test_require_torch() -> None:
    assert torch_available()  # the tests run with the device extra
    require_torch("this test")  # torch is there: nothing to say
    proc = python_without_torch(
        BLOCKER
        + textwrap.dedent(
            """
        from protofl.errors import ConfigError
        from protofl.requirements import require_torch, torch_available

        assert not torch_available()
        try:
            require_torch("protofl-server simulate")
        except ConfigError as exc:
            print(exc)
        """
        )
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == f"protofl-server simulate needs PyTorch, which is not installed: {TORCH_INSTALL_HINT}"


def test_ci_runs_the_readme_test_command() -> None:
    readme = (REPO / "README.md").read_text()
    # (the block sits between the snippet markers that docs/about.md includes it by)
    test_cmd = re.search(r"Run the tests:\n\n(?:<!-- .+? -->\n)?```\n(.+?)\n```", readme).group(1)  # type: ignore[union-attr]
    tree = "protofl edge_agent broker_server export bench tests"  # lint and types over the whole tree
    assert test_cmd.endswith(
        f"lint-imports && ruff check {tree} && ruff format --check {tree} && mypy {tree} && "
        f"mkdocs build --strict && python -m pytest -q -n 3 --dist loadfile"
    )
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == test_cmd
    # in a virtual environment (stock Debian's pip refuses a system install), every install through the lock
    assert (
        "python3 -m venv .venv && . .venv/bin/activate && export PIP_CONSTRAINT=$PWD/constraints.txt && "
        "pip install -c constraints.txt torch==2.13.0 && pip install -c constraints.txt -e '.[ci]' && "
    ) in test_cmd


def _name(requirement: str) -> str:
    """A requirement's distribution name, normalised as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", re.split(r"[\s<>=!~;\[(]", requirement.strip(), maxsplit=1)[0]).lower()


def test_the_lock_pins_every_requirement_of_the_tested_install() -> None:
    """constraints.txt pins (==) every distribution the README's commands ask for: the base install and the `ci`
    extra. A requirement added to pyproject.toml without a refresh of the lock (`.ci/lock`) fails here."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = {
        _name(r)
        for r in project["dependencies"] + project["optional-dependencies"]["ci"]
        if "python_version <" not in r
    }
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep and version and " " not in version, f"not an exact pin: {line!r}"
            pins[_name(name)] = version
    assert wanted - set(pins) == set(), "not in constraints.txt (run .ci/lock)"
    assert pins["torch"] == "2.13.0"  # the README's torch, without a local label (+cpu)


def test_explain_missing_names_the_extra_only_for_a_missing_package() -> None:
    want = r"^x needs onnxruntime, which is not installed: pip install 'protofl-edge\[onnx\]'$"
    with pytest.raises(ConfigError, match=want):
        with explain_missing("x"):
            raise ModuleNotFoundError("No module named 'onnxruntime'", name="onnxruntime")
    with pytest.raises(ImportError, match="libcudnn"):  # installed but broken: its own error, untouched
        with explain_missing("x"):
            raise ImportError("libcudnn.so.9: cannot open shared object file", name="torch._C")
