"""`protofl-edge doctor` checks what join checks, through the real command (issue 59, item 3): the data is read by
join's own function (a folder of undecodable images, a class folder the fleet does not name, numeric class folders),
the credentials file's shape (a user name that is a list, JSON nested a million deep, a binary classes file), what it
echoes made printable (a user name holding a newline forges no line), and every `--data` spelling in the docs is one
that join takes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edge_agent.ops.local_data import NAMED, PATH_KINDS
from protofl.data import own
from tests.broker_server.crash_helpers import REPO, env

CHECKS = {"credentials", "broker", "clock", "data", "classes", "torch", "onnxruntime", "memory", "disk"}


def doctor(*args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "edge_agent.cli", "doctor", *args],
        capture_output=True,
        text=True,
        env=env(OMP_NUM_THREADS="1"),
        timeout=120,
    )
    assert "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
    return done


def found(done: subprocess.CompletedProcess[str]) -> dict[str, str]:
    """doctor's lines by check; every line is one check's (no forged line)."""
    out = {}
    for line in done.stdout.splitlines():
        status, check, detail = line.split(None, 2)
        assert status in ("OK", "WARN", "FAIL") and check in CHECKS, line
        out[check] = f"{status} {detail}"
    return out


def images(folder: Path, classes: list[str], n: int = 2) -> Path:
    from PIL import Image

    rng = np.random.default_rng(0)
    for name in classes:
        (folder / name).mkdir(parents=True)
        for i in range(n):
            Image.fromarray(rng.integers(0, 255, (12, 12), dtype=np.uint8)).save(folder / name / f"{i}.png")
    return folder


def test_doctor_reads_the_data_as_join_does(tmp_path: Path) -> None:
    classes = tmp_path / "classes.txt"
    classes.write_text("shirt\nsneaker\n")
    bad = tmp_path / "bad" / "shirt"
    bad.mkdir(parents=True)
    (bad / "a.png").write_bytes(b"\x89PNG not an image" * 10)
    got = found(doctor("--data", f"imagefolder:{bad.parent}"))
    assert got["data"].startswith("FAIL") and "can be decoded" in got["data"], got

    good = images(tmp_path / "good", ["Shirt", "sneaker"])
    ok = found(doctor("--data", f"imagefolder:{good}", "--classes", str(classes)))
    assert ok["data"].startswith("OK") and "4 samples of 2 classes" in ok["data"], ok
    assert ok["classes"].startswith("OK"), ok

    typo = images(tmp_path / "typo", ["shirt", "sneakr"])
    got = found(doctor("--data", f"imagefolder:{typo}", "--classes", str(classes)))
    assert got["data"].startswith("FAIL") and "'sneakr'" in got["data"], got
    unchecked = found(doctor("--data", f"imagefolder:{typo}"))
    assert unchecked["classes"].startswith("WARN") and "not checked" in unchecked["classes"], unchecked

    numeric = images(tmp_path / "numeric", ["0", "1"])  # join maps numeric folders to class ids
    got = found(doctor("--data", f"imagefolder:{numeric}", "--classes", str(classes)))
    assert got["data"].startswith("OK") and got["classes"].startswith("OK"), got

    binary = tmp_path / "binary.txt"
    binary.write_bytes(bytes(range(256)) * 4)
    done = doctor("--data", "synthetic", "--classes", str(binary))
    assert done.returncode == 1 and found(done)["classes"].startswith("FAIL --classes file"), done.stdout

    folder = found(doctor("--data", f"folder:{good}"))
    assert folder["data"].startswith("FAIL") and "unknown kind 'folder'" in folder["data"], folder


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (json.dumps({"username": ["device-1"], "password": "pw"}).encode(), "'username' is a list, not a string"),
        (b"[" * 300_000 + b"]" * 300_000, "nested too deep"),
        (json.dumps({"password": "pw"}).encode(), "it has no 'username'"),
        (b"\x00\xff\xfe binary", "not UTF-8"),
    ],
)
def test_doctor_names_a_credentials_file_of_the_wrong_shape(tmp_path: Path, content: bytes, said: str) -> None:
    path = tmp_path / "device.json"
    path.write_bytes(content)
    done = doctor("--credentials", str(path))
    assert done.returncode == 1, done.stdout
    assert found(done)["credentials"].startswith("FAIL") and said in found(done)["credentials"], done.stdout


def test_doctor_forges_no_line_from_a_user_name_holding_a_newline(tmp_path: Path) -> None:
    path = tmp_path / "device.json"
    path.write_text(json.dumps({"username": "dev\nOK   login        forged", "password": "pw"}))
    done = doctor("--credentials", str(path))
    got = found(done)  # every line parses as one check: the newline did not start a line
    assert "login" not in got and got["credentials"].startswith("FAIL"), done.stdout
    assert "dev?OK" in got["credentials"], done.stdout


def spellings() -> list[tuple[str, str]]:
    """Every `--data VALUE` in the README and the docs, with where it is."""
    out = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        for i, line in enumerate(page.read_text().splitlines(), 1):
            for value in re.findall(r"--data[ =]+['\"]?([^\s`'\"|)]+)", line):
                out.append((f"{page.relative_to(REPO)}:{i}", value))
    return out


def test_every_data_spelling_in_the_docs_is_one_join_takes() -> None:
    found_any = spellings()
    assert len(found_any) >= 5, found_any  # the README's and the how-tos'
    for where, value in found_any:
        if value in ("...", "SPEC"):
            continue  # a placeholder the page explains
        kind, sep, _ = value.partition(":")
        assert not sep or kind.lower() in (*NAMED, *PATH_KINDS) or own.is_loader(value), f"{where}: --data {value}"
