"""What a device says it is (issue 47): its link class, its tags and its power state, at join and in its presence.

The device's profile travels beside them (`Join.profile`, e.g. "rpi4+lte"). A run's selection (broker_server/
selection.py) reads them: `--set select=tag:field-a` takes only the devices tagged `field-a`. Every field is a
member string and is bounded like one: a tag is a name (`protofl.names.NAME_RULE`, at most `MAX_TAGS` of them),
the link a label, the power state one of `POWER`, the battery level a percentage. On the wire the traits are a
map `{link, tags, power, battery}` inside `join` and a device's `status` (additive within version 1: the key
travels only with traits, and a receiver that predates them never sees one from an old device).

`read_power` reads the power state where Linux tells it (/sys/class/power_supply): "mains" when a mains supply is
online, else "battery" with the first battery's capacity; "" (unknown) where neither is found.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protofl.errors import ConfigError, WireError
from protofl.names import MAX_LABEL, NAME_RULE, is_valid_name

MAX_TAGS = 16
POWER = ("", "mains", "battery")
POWER_SUPPLY = Path("/sys/class/power_supply")
_KEYS = ("link", "tags", "power", "battery")


@dataclass(frozen=True)
class Traits:
    """`link`: the link profile's name ("" unknown); `tags`: the operator's labels (`join --tag`), sorted and unique;
    `power`: "mains", "battery" or "" (unknown); `battery`: percent charged where known, else -1."""

    link: str = ""
    tags: tuple[str, ...] = ()
    power: str = ""
    battery: int = -1

    def __post_init__(self) -> None:
        if not isinstance(self.link, str) or len(self.link) > MAX_LABEL:
            raise WireError(f"traits link: expected a string of at most {MAX_LABEL} characters")
        if self.link and not is_valid_name(self.link):
            raise WireError(f"traits link: not a valid name ({NAME_RULE})")
        if not isinstance(self.tags, (tuple, list)):
            raise WireError(f"traits tags: expected a list, got {type(self.tags).__name__}")
        if len(self.tags) > MAX_TAGS:
            raise WireError(f"traits tags: {len(self.tags)} tags, over the limit of {MAX_TAGS}")
        for t in self.tags:
            if not isinstance(t, str) or not is_valid_name(t):
                raise WireError(f"traits tag {str(t)[:40]!r}: not a valid name ({NAME_RULE})")
        object.__setattr__(self, "tags", tuple(sorted(set(self.tags))))
        if self.power not in POWER:
            raise WireError(f"traits power: expected one of mains, battery or empty, got {str(self.power)[:40]!r}")
        if isinstance(self.battery, bool) or not isinstance(self.battery, int) or not -1 <= self.battery <= 100:
            raise WireError("traits battery: expected an integer percentage in [0, 100], or -1 (unknown)")

    def to_body(self) -> dict[str, Any]:
        return {"link": self.link, "tags": list(self.tags), "power": self.power, "battery": self.battery}

    @classmethod
    def from_body(cls, body: Any) -> Traits:
        if not isinstance(body, dict) or set(body) != set(_KEYS):
            raise WireError(f"traits: expected a map with exactly the keys {', '.join(_KEYS)}")
        if not isinstance(body["tags"], list):
            raise WireError("traits tags: expected a list")
        return cls(link=body["link"], tags=tuple(body["tags"]), power=body["power"], battery=body["battery"])

    def describe(self) -> str:
        """One short line: "link lte, tags field-a, battery 80 %"."""
        parts = [f"link {self.link}"] if self.link else []
        if self.tags:
            parts.append("tags " + ",".join(self.tags))
        if self.power == "battery":
            parts.append(f"battery {self.battery} %" if self.battery >= 0 else "battery")
        elif self.power:
            parts.append(self.power)
        return ", ".join(parts)


def check_tags(tags: Iterable[str]) -> tuple[str, ...]:
    """`join --tag` values: each a name, at most MAX_TAGS; raises ConfigError saying which is wrong."""
    out = tuple(tags)
    for t in out:
        if not is_valid_name(t):
            raise ConfigError(f"--tag '{t}' is not a valid tag ({NAME_RULE})")
    if len(set(out)) > MAX_TAGS:
        raise ConfigError(f"at most {MAX_TAGS} --tag values, got {len(set(out))}")
    return tuple(sorted(set(out)))


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        return ""


def read_power(root: Path = POWER_SUPPLY) -> tuple[str, int]:
    """(power, battery percent) from Linux's power supply class: ("mains", -1) when a mains supply is online,
    ("battery", level) when a battery is found (level -1 where it does not say), ("", -1) when neither is."""
    try:
        supplies = sorted(p for p in root.iterdir() if p.is_dir())
    except OSError:
        return "", -1
    battery: int | None = None
    for s in supplies:
        kind = _read(s / "type").lower()
        if kind == "mains" and _read(s / "online") == "1":
            return "mains", -1
        if kind == "battery" and battery is None:
            level = _read(s / "capacity")
            battery = int(level) if level.isdigit() and int(level) <= 100 else -1
    return ("battery", battery) if battery is not None else ("", -1)


def device_traits(link: str, tags: Iterable[str], root: Path = POWER_SUPPLY) -> Traits:
    """This device's traits: its link profile's name, its tags (checked), its power state as Linux tells it."""
    power, battery = read_power(root)
    return Traits(link=link, tags=check_tags(tags), power=power, battery=battery)
