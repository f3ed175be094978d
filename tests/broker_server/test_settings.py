"""The server's settings groups (broker_server/settings.py): validated when built, each refusal naming the option,
sequences kept as tuples so a group stays frozen all the way down."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker_server.settings import (
    DEFAULT_SHARD_TIMEOUT_S,
    Admission,
    Broker,
    Durability,
    Federation,
    Pacing,
    Sharding,
    ShardSettings,
)
from protofl.errors import ConfigError
from protofl.presets import make_config
from protofl.transport.broker_url import parse_broker_url


def test_each_group_refuses_a_bad_value_naming_its_option(tmp_path: Path) -> None:
    cfg = make_config("fedproto")
    cases = [
        (lambda: Federation(cfg, offline_grace=-1), "--offline-grace must be >= 0"),
        (lambda: Admission(max_clients=0), "--max-clients must be at least 1"),
        (lambda: Sharding(shards=-1), "--shards must be >= 0"),
        (lambda: Sharding(timeout=0), "--shard-timeout must be > 0"),
        (lambda: Broker(parse_broker_url("mqtt://h:1"), queue=0), "--broker-queue must be at least 1"),
        (lambda: Pacing(resend_window=0), "re-send window must be at least 1"),
        (lambda: ShardSettings("f", tmp_path), "either --index I .* or --site NAME"),
        (lambda: ShardSettings("f", tmp_path, index=0, site="a"), "either --index I .* or --site NAME"),
        (lambda: ShardSettings("f", tmp_path, index=-2), "--index must be >= 0"),
    ]
    (tmp_path / "file").write_text("")
    cases.append((lambda: Durability(tmp_path / "file"), "--state-dir .* is a file"))
    for build, message in cases:
        with pytest.raises(ConfigError, match=message):
            build()


def test_groups_are_frozen_with_their_defaults_in_one_place(tmp_path: Path) -> None:
    fed = Federation(make_config("fedproto"), "f", expected_clients=["a", "b"])
    assert fed.expected_clients == ("a", "b") and Admission(["x"]).members == ("x",)
    with pytest.raises(AttributeError):
        fed.fed = "other"  # type: ignore[misc]
    assert Sharding().timeout == ShardSettings("f", tmp_path, index=0).timeout == DEFAULT_SHARD_TIMEOUT_S
    assert not Sharding().active and Sharding(sites=["a"]).active and not Durability().enabled
    core, site = ShardSettings("f", tmp_path, index=1, timeout=2.5), ShardSettings("f", tmp_path, site="a")
    assert (core.name, core.session_expiry) == ("shard-1", 3) and site.name == "site-a"
    assert site.session_expiry == 3600  # the site broker's only reader waits as long as a device
