"""Device and link profiles: every shipped file loads and cites its sources; bad ones say what is wrong."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10, which the project supports: the same parser, from PyPI (as protofl.profiles does)
    import tomli as tomllib

from protofl.errors import ConfigError
from protofl.profiles import (
    SHIPPED,
    DeviceProfile,
    LinkProfile,
    Outage,
    known_profiles,
    load_device,
    load_link,
    load_profile,
    parse_fleet,
    parse_pair,
)

REPO = Path(__file__).resolve().parents[2]
DEVICES = {"rpi3", "rpi4", "rpi5", "jetson-nano", "jetson-orin-nano", "x86-cpu", "x86-gpu"}
LINKS = {"ethernet", "wifi", "lte", "lte-m", "nb-iot", "satellite"}


def test_every_issue_profile_is_shipped_and_loads() -> None:
    known = known_profiles()
    assert DEVICES | LINKS <= set(known)
    for name in DEVICES:
        assert isinstance(load_profile(name), DeviceProfile)
    for name in LINKS:
        assert isinstance(load_profile(name), LinkProfile)


@pytest.mark.parametrize("name", sorted(DEVICES | LINKS))
def test_every_value_cites_a_source_in_a_comment(name: str) -> None:
    # Each key line or the comment block just above it names where the value comes from.
    lines = (SHIPPED / f"{name}.toml").read_text().splitlines()
    for i, line in enumerate(lines):
        key = line.split("=")[0].strip()
        if "=" not in line or line.lstrip().startswith("#") or key in ("kind", "description"):
            continue
        block = [line]
        j = i - 1
        while j >= 0 and lines[j].strip():  # up to the blank line before its group
            block.append(lines[j])
            j -= 1
        assert any("#" in b for b in block), f"{name}.toml: '{key}' has no comment citing its source"


def test_the_nb_iot_uplink_is_the_issue_s_fifteen_minutes_for_fedavg() -> None:
    nb = load_link("nb-iot")
    assert 6.8e6 / nb.uplink_bytes_per_s / 60 == pytest.approx(14.5, abs=0.1)  # 6.8 MB at 62.5 kbit/s


def test_shipped_profiles_are_package_data() -> None:
    # protofl/_profiles is a link to the top-level profiles/ and the wheel takes its TOML files.
    assert (REPO / "protofl" / "_profiles").resolve() == (REPO / "profiles").resolve()
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "_profiles/*.toml" in pyproject["tool"]["setuptools"]["package-data"]["protofl"]


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"^profile 'rpi9' not found; known: ethernet, jetson-nano, .*rpi4"):
        load_profile("rpi9")


def write(tmp_path: Path, text: str, name: str = "mine.toml") -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


LINK = 'kind = "link"\nuplink_kbps = 100\ndownlink_kbps = 200\nrtt_ms = 50\njitter_ms = 5\n'


def test_a_copied_file_is_a_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    link = load_link(write(tmp_path, LINK + "[outage]\nevery_s = 60\nduration_s = 5\nfirst_s = 10\n"))
    assert link.name == "mine" and link.uplink_bytes_per_s == 12_500 and link.outage == Outage(60, 5, 10)
    # 10 s in: down for 5 s, then up until 70 s
    assert [link.outage.down_at(t) for t in (9.9, 10.0, 14.9, 15.0, 70.0)] == [False, True, True, False, True]
    monkeypatch.setenv("PROTOFL_PROFILES", str(tmp_path))  # a directory of one's own, searched by NAME
    assert load_link("mine") == link


@pytest.mark.parametrize(
    "text, message",
    [
        (LINK + "bandwidth = 3\n", r"unknown key\(s\) \['bandwidth'\]; known keys: \['downlink_kbps', "),
        (LINK.replace("uplink_kbps = 100", "uplink_kbps = -1"), r"'uplink_kbps' must be > 0 .* got -1"),
        (LINK.replace("rtt_ms = 50\n", ""), r"missing key\(s\) \['rtt_ms'\]"),
        (LINK.replace("rtt_ms = 50", 'rtt_ms = "fast"'), r"'rtt_ms' must be a number, got 'fast'"),
        (LINK + "[outage]\nevery_s = 5\nduration_s = 5\n", r"duration_s \(5\) must be shorter than every_s \(5\)"),
        ('kind = "device"\ncompute_factor = 0\nmemory_mb = 10\n', r"'compute_factor' must be > 0"),
        ('kind = "device"\ncompute_factor = 1\nmemory_mb = 1.5\n', r"'memory_mb' must be an integer"),
        ('kind = "phone"\n', r"'kind' must be \"device\" or \"link\", got 'phone'"),
        ("kind = ", r"is not valid TOML"),
    ],
)
def test_bad_profiles_say_what_is_wrong(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=message) as info:
        load_profile(path)
    assert path in str(info.value)  # which file


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match=r"^profile file 'nowhere/x.toml' not found$"):
        load_profile("nowhere/x.toml")


def test_pairs_and_fleets() -> None:
    device, link = parse_pair("rpi4+lte")
    assert device == load_device("rpi4") and link == load_link("lte")
    assert parse_pair("nb-iot") == (None, load_link("nb-iot"))
    fleet = parse_fleet("rpi4+lte:4,jetson-orin-nano+wifi:2,rpi3+nb-iot")
    assert [(c.name, c.count) for c in fleet] == [("rpi4+lte", 4), ("jetson-orin-nano+wifi", 2), ("rpi3+nb-iot", 1)]
    for bad, message in (
        ("rpi4+rpi3", "names two devices"),
        ("rpi4:x", "is not an integer"),
        ("rpi4+lte:0", "count must be >= 1"),
        ("rpi4:2", "give a device and a link"),
        ("rpi4+lte,,", "empty entry"),
    ):
        with pytest.raises(ConfigError, match=message):
            parse_fleet(bad)
    with pytest.raises(ConfigError, match="is a link profile; a device profile is needed"):
        load_device("wifi")


@pytest.mark.slow
def test_the_wheel_carries_the_profiles(tmp_path: Path) -> None:
    # What a `pip install protofl-edge` user gets: the built wheel holds every profile under protofl/_profiles.
    import shutil
    import subprocess
    import sys
    import zipfile

    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for name in ("protofl", "edge_agent", "broker_server", "export", "profiles"):
        shutil.copytree(REPO / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    shipped = {Path(n).name for n in zipfile.ZipFile(wheel).namelist() if n.startswith("protofl/_profiles/")}
    assert shipped == {f"{n}.toml" for n in DEVICES | LINKS}
