"""The docs cannot drift from the code: every shell block of the tutorials and how-to guides runs here.

A page's ```bash blocks run in order, as one bash script, through the real commands (`protofl-server`,
`protofl-edge`, `protofl-export` of this checkout), in a fresh directory that holds a `tests` link to the
repository's (the pages' commands are typed in a clone). Where a page says its sizes are made smaller in the doc
tests (`<!-- doc-test sizes: --opt N ... -->`, and a note that says the same to the reader), each of those options
takes that value where a command gives it, and every `protofl-server simulate` or `start` that takes it but does
not give it gets it added. Port 1883 becomes a free port. A block whose first line is
`# not run by the doc tests: REASON` is not run (a real Raspberry Pi, an installer); the reason is required.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

from tests import launcher, launcher_client

REPO = Path(__file__).resolve().parents[1]
CLIENT = Path(launcher_client.__file__).resolve()
DOCS = REPO / "docs"
PAGES = sorted([*DOCS.glob("tutorials/*.md"), *DOCS.glob("how-to/*.md")])
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
SIZES = re.compile(r"<!-- doc-test sizes: (.+?) -->")
NOT_RUN = "# not run by the doc tests:"
TIMEOUT_S = 900


@dataclass(frozen=True)
class Page:
    path: Path
    run: list[str]  # the bash blocks the test runs, in order
    skipped: list[str]  # the reasons of those it does not
    sizes: list[tuple[str, str]]  # (option, value) the doc tests use instead


def read_page(path: Path) -> Page:
    text = path.read_text()
    run, skipped = [], []
    for lang, body in BLOCK.findall(text):
        if lang != "bash":
            continue
        first = body.splitlines()[0] if body.strip() else ""
        if first.startswith(NOT_RUN):
            skipped.append(first[len(NOT_RUN) :].strip())
        else:
            run.append(body)
    sizes: list[tuple[str, str]] = []
    for found in SIZES.findall(text):
        words = shlex.split(found)
        sizes += list(zip(words[::2], words[1::2], strict=True))
    return Page(path, run, skipped, sizes)


@functools.cache
def server_options(command: str) -> frozenset[str]:
    """The options `protofl-server COMMAND` takes (a size is added only to a command that has the option)."""
    import typer

    from broker_server.cli import app

    cmd = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    return frozenset(name for p in cmd.params for name in p.opts)


def with_sizes(script: str, sizes: list[tuple[str, str]]) -> str:
    """The script with the page's doc-test sizes: replaced where given, added to every `simulate` or `start` that
    takes the option and lacks it."""
    lines = script.replace("\\\n", " ").splitlines()  # one line per command
    out = []
    for line in lines:
        server = re.search(r"protofl-server (simulate|start)\b", line)
        for opt, value in sizes:
            # `--set key=value` is one option per key; any other option is one option
            given = re.escape(opt) + (rf"[ =]{re.escape(value.split('=')[0])}=\S+" if opt == "--set" else r"[ =]\S+")
            if re.search(given, line):
                line = re.sub(given, f"{opt} {value}", line)
            elif server and opt in server_options(server.group(1)):
                code, sep, comment = line.partition("  #")
                code, amp = code.rstrip(), ""
                if code.endswith("&"):  # a command sent to the background
                    code, amp = code[:-1].rstrip(), " &"
                line = f"{code} {opt} {value}{amp}" + (f"  {sep.strip()}{comment}" if sep else "")
        out.append(line)
    return "\n".join(out) + "\n"


def shims(where: Path) -> Path:
    """`protofl-server` & co. as this checkout's modules (the installed console scripts may be another tree's)."""
    bin_dir = where / "bin"
    bin_dir.mkdir()
    with (REPO / "pyproject.toml").open("rb") as fh:
        scripts = tomllib.load(fh)["project"]["scripts"]
    for name, target in scripts.items():
        module = target.split(":")[0]
        shim = bin_dir / name
        # Through the test launcher where the test named one (tests/launcher_client.py), else a fresh interpreter.
        shim.write_text(
            f'#!/bin/sh\nexport PYTHONPATH="{REPO}${{PYTHONPATH:+:$PYTHONPATH}}"\n'
            f'[ -n "${{{launcher_client.SOCKET}:-}}" ] && exec {sys.executable} -S {CLIENT} {module} "$@"\n'
            f'exec {sys.executable} -m {module} "$@"\n'
        )
        shim.chmod(0o755)
    # A script, not a symlink: a venv's interpreter started through a link elsewhere finds no pyvenv.cfg beside
    # it and runs without the venv's packages.
    python = bin_dir / "python"
    python.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    python.chmod(0o755)
    return bin_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_every_page_has_its_blocks_run_or_says_why() -> None:
    assert PAGES, "no tutorial or how-to pages found"
    for path in PAGES:
        page = read_page(path)
        text = path.read_text()
        assert all(page.skipped), f"{path.name}: a block not run must say why after {NOT_RUN!r}"
        assert "```console" not in text and "```sh\n" not in text, f"{path.name}: shell blocks are ```bash"
        for opt, value in page.sizes:  # the reader is told what the test changes
            assert f"`{opt} {value}" in text or f" {opt} {value}" in text.split("-->", 1)[-1], (path.name, opt)
    assert read_page(DOCS / "tutorials" / "field-trial.md").skipped == [
        "needs a server box and Raspberry Pis on one network, and SSH between them"
    ]


def test_sizes_replace_and_add() -> None:
    script = "protofl-server simulate --rounds 20 --json out.json  # comment\nprotofl-edge models\n"
    got = with_sizes(script, [("--rounds", "1"), ("--train-limit", "600"), ("--train-n", "300")])
    want = "protofl-server simulate --rounds 1 --json out.json --train-limit 600  # comment\nprotofl-edge models\n"
    assert got == want
    got = with_sizes("protofl-server simulate --set a=1 --set b=2\n", [("--set", "b=3"), ("--set", "c=4")])
    assert got == "protofl-server simulate --set a=1 --set b=3 --set c=4\n"
    got = with_sizes("protofl-server start \\\n    --rounds 5 &  # in the background\n", [("--set", "e=1")])
    assert got == "protofl-server start      --rounds 5 --set e=1 &  # in the background\n"


@pytest.mark.slow
@pytest.mark.mosquitto
@pytest.mark.parametrize("path", [p for p in PAGES if read_page(p).run], ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_the_page_runs(path: Path, tmp_path: Path) -> None:
    page = read_page(path)
    port = str(free_port())
    script = "set -euo pipefail\n" + "".join(with_sizes(b, page.sizes) for b in page.run).replace("1883", port)
    work = tmp_path / "work"
    work.mkdir()
    (work / "tests").symlink_to(REPO / "tests")
    env = dict(os.environ, PATH=f"{shims(tmp_path)}{os.pathsep}{os.environ['PATH']}", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(REPO)  # `python` in a block imports this checkout too
    socket_path = launcher.socket_for(env)
    if socket_path is not None:
        env[launcher_client.SOCKET] = socket_path
    log = tmp_path / "output.log"  # a file, not a pipe: a failed page's background server would hold a pipe open
    with log.open("w") as fh:
        proc = subprocess.Popen(
            ["bash", "-c", script], cwd=work, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            proc.wait(timeout=TIMEOUT_S)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # what a failed page left in the background
            except ProcessLookupError:
                pass
    out = log.read_text(errors="replace")
    assert proc.returncode == 0, f"{path.relative_to(REPO)} failed:\n{script}\n--- output ---\n{out[-6000:]}"
