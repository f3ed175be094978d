"""Device traits (issue 47): bounded like every member string, additive on the wire, power read from sysfs."""

from __future__ import annotations

from pathlib import Path

import pytest

from protofl.errors import ConfigError, WireError
from protofl.traits import MAX_TAGS, Traits, check_tags, device_traits, read_power
from protofl.wire import Join, Status, decode_message, encode_message


def _supply(root: Path, name: str, **files: str) -> None:
    (root / name).mkdir(parents=True)
    for k, v in files.items():
        (root / name / k).write_text(v + "\n")


def test_power_from_sysfs(tmp_path: Path) -> None:
    assert read_power(tmp_path / "absent") == ("", -1)
    bat = tmp_path / "bat"
    _supply(bat, "BAT0", type="Battery", capacity="73")
    assert read_power(bat) == ("battery", 73)
    _supply(bat, "AC", type="Mains", online="0")  # unplugged: still on battery
    assert read_power(bat) == ("battery", 73)
    mains = tmp_path / "mains"
    _supply(mains, "AC", type="Mains", online="1")
    _supply(mains, "BAT0", type="Battery", capacity="12")
    assert read_power(mains) == ("mains", -1)
    odd = tmp_path / "odd"
    _supply(odd, "BAT1", type="Battery", capacity="garbage")
    assert read_power(odd) == ("battery", -1)
    t = device_traits("lte", ["roof", "field-a", "roof"], bat)
    assert t == Traits("lte", ("field-a", "roof"), "battery", 73)
    assert t.describe() == "link lte, tags field-a,roof, battery 73 %"


def test_tags_are_checked_at_the_command_line() -> None:
    with pytest.raises(ConfigError, match="not a valid tag"):
        check_tags(["field a"])
    with pytest.raises(ConfigError, match="at most 16"):
        check_tags([f"t{i}" for i in range(MAX_TAGS + 1)])


@pytest.mark.parametrize(
    "body, why",
    [
        ({"link": "lte", "tags": ["a b"], "power": "", "battery": -1}, "not a valid name"),
        ({"link": "lte", "tags": [f"t{i}" for i in range(MAX_TAGS + 1)], "power": "", "battery": -1}, "over the limit"),
        ({"link": "x" * 200, "tags": [], "power": "", "battery": -1}, "at most 128"),
        ({"link": "lte", "tags": [], "power": "solar", "battery": -1}, "power"),
        ({"link": "lte", "tags": [], "power": "battery", "battery": 101}, "percentage"),
        ({"link": "lte", "tags": [], "power": "battery", "battery": True}, "percentage"),
        ({"link": "lte", "tags": "field-a", "power": "", "battery": -1}, "expected a list"),
        ({"link": "lte", "tags": [], "power": ""}, "exactly the keys"),
    ],
)
def test_hostile_traits_are_refused_on_the_wire(body: dict, why: str) -> None:
    good = encode_message(Join("cnn", 5, traits=Traits("lte")), fed="f", sender="d1")
    import msgpack

    env = msgpack.unpackb(good, raw=False)
    env["body"]["traits"] = body
    with pytest.raises(WireError, match=why):
        decode_message(msgpack.packb(env, use_bin_type=True))


def test_traits_are_additive() -> None:
    """A join or status without traits is the bytes it always was; with them it round-trips."""
    plain = encode_message(Join("cnn", 5, profile="rpi4"), fed="f", sender="d1", msg_id="m")
    assert b"traits" not in plain
    t = Traits("nb-iot", ("field-a",), "mains")
    _, back = decode_message(encode_message(Status("online", traits=t), fed="f", sender="d1"))
    assert isinstance(back, Status) and back.traits == t
