"""Watching a `protofl-server start` as printed (issue 42): the watcher command the server logs works as it is
printed (its monitor.json says where the broker is), and the live page works with its password in the URL
(`http://protofl:PW@host:port/`). Real `start` processes; the page in headless Chromium."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker_server.ops.broker import free_port
from tests.broker_server.browser import chromium, eventually

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")


@pytest.fixture
def browser() -> Iterator[object]:
    yield from chromium()


def start(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen[str], Path]:
    log = tmp_path / "server.log"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "broker_server.cli",
            "start",
            "--preset",
            "fedproto",
            "--fed",
            "watched",
            "--min-clients",
            "3",
            "--port",
            str(free_port()),
            *extra,
        ],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=ENV,
        text=True,
    )
    return proc, log


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.mosquitto
def test_the_printed_watcher_command_works_as_printed(tmp_path: Path) -> None:
    proc, log = start(tmp_path, "--state-dir", str(tmp_path / "state"))
    try:
        printed = eventually(
            lambda: re.search(r"watchers: (protofl-server status [^\n]*)", log.read_text()) or proc.poll() is not None,
            60,
            "the watcher command in the server's log",
        )
        assert proc.poll() is None, log.read_text()
        assert isinstance(printed, re.Match)
        args = shlex.split(printed.group(1))
        assert args[:2] == ["protofl-server", "status"] and "--broker" not in args, args
        # as printed (the entry point is this checkout's module), from another directory than the server's
        out = subprocess.run(
            [sys.executable, "-m", "broker_server.cli", *args[1:]],
            capture_output=True,
            text=True,
            env=ENV,
            timeout=60,
            cwd=tmp_path,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        assert "federation 'watched' (fedproto): waiting" in out.stdout, out.stdout
    finally:
        stop(proc)


@pytest.mark.mosquitto
def test_the_live_page_works_with_its_password_in_the_url(tmp_path: Path, browser: object) -> None:
    ui_port = free_port()
    proc, log = start(tmp_path, "--insecure", "--ui-port", str(ui_port), "--ui-password", "s3cret-pw")
    try:
        eventually(lambda: "live page" in log.read_text() or proc.poll() is not None, 60, "the live page")
        assert proc.poll() is None, log.read_text()
        browser.get(f"http://protofl:s3cret-pw@127.0.0.1:{ui_port}/")  # type: ignore[attr-defined]

        def shown() -> tuple[str, str]:
            find = browser.find_element  # type: ignore[attr-defined]
            return find("id", "state").text, find("id", "error").text

        try:
            eventually(lambda: shown()[0] == "waiting", 30, "the page to show the waiting federation")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the page shows {shown()}") from None
        assert browser.find_element("id", "fed").text == "watched (fedproto)"  # type: ignore[attr-defined]
    finally:
        stop(proc)
