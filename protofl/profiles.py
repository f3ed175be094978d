"""Device and link profiles: TOML files in `profiles/` (shipped inside the package as `protofl/_profiles`).

A device profile states how fast the device trains, as a factor of the machine running the simulation
(`compute_factor`, 1.0 = x86-cpu), its memory, and the CPU threads inference may use there (`threads`:
what `protofl-export bench --profile` runs onnxruntime and torch with). A link profile states uplink and downlink rate,
round-trip time, jitter and an optional periodic outage. Each shipped value cites its source in a
comment of its file. A user adds a profile by copying a file: `--profile FILE` reads any file, and
`$PROTOFL_PROFILES` (a path list) names extra directories searched by NAME before the shipped ones.

A fleet entry names a device and a link, `rpi4+lte`; a fleet is `rpi4+lte:4,jetson-orin-nano+wifi:2`.
Everything here is validated on load: an unknown, missing or out-of-range key is a `ConfigError` that
says which file and what to write instead. No numpy.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 (a Jetson on JetPack 6): the same parser, from PyPI
    import tomli as tomllib

from protofl.errors import ConfigError

SHIPPED = Path(__file__).resolve().parent / "_profiles"  # a link to the top-level profiles/ in a checkout
ENV_PATH = "PROTOFL_PROFILES"


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    description: str
    compute_factor: float  # local-training throughput / this machine's (1.0 = as fast as this machine)
    memory_mb: int
    threads: int | None = None  # CPU cores inference may use on the device (None: not stated)


@dataclass(frozen=True)
class Outage:
    """A periodic loss of the link: down for `duration_s` at first_s, first_s + every_s, ... (simulated s)."""

    every_s: float
    duration_s: float
    first_s: float = 0.0

    def down_at(self, t: float) -> bool:
        """Whether the link is down at simulated time `t` (seconds since the link came up)."""
        if t < self.first_s:
            return False
        return (t - self.first_s) % self.every_s < self.duration_s


@dataclass(frozen=True)
class LinkProfile:
    name: str
    description: str
    uplink_kbps: float
    downlink_kbps: float
    rtt_ms: float
    jitter_ms: float
    outage: Outage | None = None

    @property
    def uplink_bytes_per_s(self) -> float:
        return self.uplink_kbps * 1000 / 8

    @property
    def downlink_bytes_per_s(self) -> float:
        return self.downlink_kbps * 1000 / 8


Profile = DeviceProfile | LinkProfile

# key -> (type, lower bound, upper bound, bound is exclusive below); None bounds = unbounded
_Schema = dict[str, tuple[tuple[type[int] | type[float], ...], float | None, float | None]]
_NUM = (int, float)
_DEVICE_KEYS: _Schema = {
    "compute_factor": (_NUM, 0.0, 1e4),
    "memory_mb": ((int,), 0.0, 1e8),
    "threads": ((int,), 0.0, 1024),
}
_LINK_KEYS: _Schema = {
    "uplink_kbps": (_NUM, 0.0, 1e8),
    "downlink_kbps": (_NUM, 0.0, 1e8),
    "rtt_ms": (_NUM, -1.0, 1e6),
    "jitter_ms": (_NUM, -1.0, 1e6),
}
_OUTAGE_KEYS: _Schema = {
    "every_s": (_NUM, 0.0, 1e9),
    "duration_s": (_NUM, 0.0, 1e9),
    "first_s": (_NUM, -1.0, 1e9),
}
_ZERO_OK = {"rtt_ms", "jitter_ms", "first_s"}  # may be 0; every other number must be > 0


def search_dirs() -> list[Path]:
    """Where NAME is looked up: `$PROTOFL_PROFILES` entries, then the shipped profiles."""
    extra = [Path(p) for p in os.environ.get(ENV_PATH, "").split(os.pathsep) if p]
    return [*extra, SHIPPED]


def known_profiles() -> dict[str, Path]:
    """Every profile NAME found, to its file (an earlier directory wins)."""
    found: dict[str, Path] = {}
    for d in search_dirs():
        if d.is_dir():
            for f in sorted(d.glob("*.toml")):
                found.setdefault(f.stem, f)
    return found


def _is_file_spec(spec: str) -> bool:
    return spec.endswith(".toml") or os.sep in spec or "/" in spec


def _check_keys(table: dict[str, Any], schema: _Schema, where: str, optional: set[str]) -> dict[str, float]:
    unknown = sorted(set(table) - set(schema))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; known keys: {sorted(schema)}")
    missing = sorted(set(schema) - set(table) - optional)
    if missing:
        raise ConfigError(f"{where}: missing key(s) {missing}")
    out: dict[str, float] = {}
    for key, value in table.items():
        types, low, high = schema[key]
        if isinstance(value, bool) or not isinstance(value, types):
            want = "an integer" if types == (int,) else "a number"
            raise ConfigError(f"{where}: '{key}' must be {want}, got {value!r}")
        v = float(value)
        floor_ok = v >= 0 if key in _ZERO_OK else v > 0
        if not math.isfinite(v) or not floor_ok or (high is not None and v > high):
            bound = ">= 0" if key in _ZERO_OK else "> 0"
            raise ConfigError(f"{where}: '{key}' must be {bound} and at most {high:g}, got {value!r}")
        out[key] = value
    return out


def parse_profile(data: dict[str, Any], name: str, where: str) -> Profile:
    """A profile from a parsed TOML table; `where` names it in errors (a file path)."""
    data = dict(data)
    kind = data.pop("kind", None)
    description = data.pop("description", "")
    if not isinstance(description, str):
        raise ConfigError(f"{where}: 'description' must be a string, got {description!r}")
    if kind == "device":
        v = _check_keys(data, _DEVICE_KEYS, where, {"threads"})
        return DeviceProfile(
            name,
            description,
            float(v["compute_factor"]),
            int(v["memory_mb"]),
            int(v["threads"]) if "threads" in v else None,
        )
    if kind == "link":
        outage_table = data.pop("outage", None)
        v = _check_keys(data, _LINK_KEYS, where, set())
        outage = None
        if outage_table is not None:
            if not isinstance(outage_table, dict):
                raise ConfigError(f"{where}: 'outage' must be a table ([outage] with every_s, duration_s)")
            o = _check_keys(outage_table, _OUTAGE_KEYS, f"{where} [outage]", {"first_s"})
            outage = Outage(float(o["every_s"]), float(o["duration_s"]), float(o.get("first_s", 0.0)))
            if outage.duration_s >= outage.every_s:
                raise ConfigError(
                    f"{where} [outage]: duration_s ({outage.duration_s:g}) must be shorter than "
                    f"every_s ({outage.every_s:g}), or the link is never up"
                )
        return LinkProfile(
            name,
            description,
            float(v["uplink_kbps"]),
            float(v["downlink_kbps"]),
            float(v["rtt_ms"]),
            float(v["jitter_ms"]),
            outage,
        )
    raise ConfigError(f'{where}: \'kind\' must be "device" or "link", got {kind!r}')


def load_profile(spec: str) -> Profile:
    """A profile by NAME (see `search_dirs`) or from a FILE path."""
    if _is_file_spec(spec):
        path = Path(spec)
        if not path.is_file():
            raise ConfigError(f"profile file '{spec}' not found")
        name = path.stem
    else:
        known = known_profiles()
        if spec not in known:
            raise ConfigError(f"profile '{spec}' not found; known: {', '.join(sorted(known))} (or give a .toml file)")
        path, name = known[spec], spec
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"profile file '{path}' is not valid TOML: {exc}") from exc
    return parse_profile(data, name, str(path))


def _load_as(spec: str, cls: type, what: str, other: str, examples: str) -> Any:
    p = load_profile(spec)
    if not isinstance(p, cls):
        raise ConfigError(f"profile '{spec}' is a {other} profile; a {what} profile is needed here (e.g. {examples})")
    return p


def load_device(spec: str) -> DeviceProfile:
    return _load_as(spec, DeviceProfile, "device", "link", "rpi4, jetson-orin-nano")


def load_link(spec: str) -> LinkProfile:
    return _load_as(spec, LinkProfile, "link", "device", "wifi, lte, nb-iot")


@dataclass(frozen=True)
class DeviceClass:
    """One kind of simulated device: what it is, what it talks over, how many of them."""

    device: DeviceProfile
    link: LinkProfile
    count: int = 1
    spec: str = ""  # as given (NAME or FILE parts), for a device process to load the same profiles

    @property
    def name(self) -> str:
        return f"{self.device.name}+{self.link.name}"


def parse_pair(spec: str) -> tuple[DeviceProfile | None, LinkProfile | None]:
    """`DEVICE`, `LINK`, `DEVICE+LINK` (each a NAME or FILE) -> (device or None, link or None)."""
    device: DeviceProfile | None = None
    link: LinkProfile | None = None
    parts = [p.strip() for p in spec.split("+")]
    if not spec.strip() or len(parts) > 2 or not all(parts):
        raise ConfigError(f"profile '{spec}': expected DEVICE, LINK or DEVICE+LINK (e.g. rpi4+lte)")
    for part in parts:
        p = load_profile(part)
        if isinstance(p, DeviceProfile):
            if device is not None:
                raise ConfigError(f"profile '{spec}' names two devices; write DEVICE+LINK")
            device = p
        else:
            if link is not None:
                raise ConfigError(f"profile '{spec}' names two links; write DEVICE+LINK")
            link = p
    return device, link


def parse_fleet(spec: str) -> list[DeviceClass]:
    """`rpi4+lte:4,jetson-orin-nano+wifi:2` -> device classes (count 1 when `:N` is left out)."""
    fleet: list[DeviceClass] = []
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            raise ConfigError(f"--profiles '{spec}': empty entry; write DEVICE+LINK:COUNT,...")
        pair, _, count_text = entry.rpartition(":") if ":" in entry else (entry, "", "1")
        try:
            count = int(count_text)
        except ValueError:
            raise ConfigError(f"--profiles entry '{entry}': count '{count_text}' is not an integer") from None
        if count < 1:
            raise ConfigError(f"--profiles entry '{entry}': count must be >= 1, got {count}")
        device, link = parse_pair(pair)
        if device is None or link is None:
            raise ConfigError(f"--profiles entry '{entry}': give a device and a link, DEVICE+LINK (e.g. rpi4+lte)")
        fleet.append(DeviceClass(device, link, count, pair.strip()))
    return fleet
