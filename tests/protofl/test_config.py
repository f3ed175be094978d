"""Config and presets: validation says what was wrong; presets are data; the dict form round-trips."""

from __future__ import annotations

import pytest

from protofl import registry as _registry
from protofl.config import FederationConfig
from protofl.errors import ConfigError
from protofl.plan import RoundPlan
from protofl.presets import PRESETS, make_config

OPTIONS = _registry.options()


@pytest.mark.parametrize("preset", list(PRESETS))
def test_presets_build_and_round_trip(preset: str) -> None:
    cfg = make_config(preset)
    assert cfg.preset == preset
    assert FederationConfig.from_dict(cfg.to_dict()) == cfg


def test_preset_stage_switches() -> None:
    assert make_config("fedavg").federate == "full"
    assert RoundPlan.from_config(make_config("tinyproto")).proto_width == 51  # s = m/10 with m = 512
    assert make_config("tinyproto").cps and make_config("tinyproto").scaling
    r = make_config("refprotofl")
    assert r.erpa and r.apud and RoundPlan.from_config(r).public_classes == tuple(range(10))
    assert make_config("fedpagr").prototypes == "unit"


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (dict(rounds=0), "rounds must be >= 1"),
        (dict(lr=-1.0), "lr must be > 0"),
        (dict(lr=float("nan")), "finite number"),
        (dict(mu="sometimes"), "mu must be a positive number or 'auto'"),
        (dict(apud_ratio=1.5), "apud_ratio"),
        (dict(backbone="melted"), "backbone must be"),
        (dict(public_classes=(42,)), "public_classes"),
        (dict(cps_s=0), "cps_s"),
        (dict(num_classes=True), "must be an integer"),
        (dict(archs=("cnn", "mlp")), "one architecture"),  # fedavg cannot mix architectures
    ],
)
def test_bad_values_are_rejected_with_a_reason(overrides: dict, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace("[", r"\[")):
        make_config("fedavg", **overrides)


def test_unknown_preset_and_keys() -> None:
    with pytest.raises(ConfigError, match="known: fedavg"):
        make_config("fedmagic")
    with pytest.raises(ConfigError, match="unknown config key"):
        make_config("fedproto", learning_rate=0.1)


def test_config_file(tmp_path) -> None:
    path = tmp_path / "fed.toml"
    path.write_text('[federation]\nrounds = 7\nmu = "auto"\narchs = ["cnn", "mlp"]\n')
    cfg = make_config("tinyproto", str(path))
    assert cfg.rounds == 7 and cfg.mu == "auto" and cfg.archs == ("cnn", "mlp")
    bad = tmp_path / "bad.toml"
    bad.write_text("rounds = = 3")
    with pytest.raises(ConfigError, match="not valid TOML"):
        make_config("tinyproto", str(bad))
    with pytest.raises(ConfigError, match="not found"):
        make_config("tinyproto", str(tmp_path / "missing.toml"))


def test_the_preset_is_chosen_by_name_not_overridden() -> None:
    # `--set preset=fedproto` used to end in a TypeError; it is an error that says how to choose a preset
    with pytest.raises(ConfigError, match="chosen with --preset fedproto"):
        make_config("fedavg", preset="fedproto")
    assert make_config("fedavg", preset="fedavg").preset == "fedavg"


def test_a_config_file_cannot_change_the_preset(tmp_path) -> None:
    path = tmp_path / "fed.toml"
    path.write_text('preset = "fedproto"\nrounds = 3\n')
    with pytest.raises(ConfigError, match="says preset = 'fedproto'"):
        make_config("tinyproto", str(path))


def test_a_technique_option_may_not_shadow_a_core_field(monkeypatch: pytest.MonkeyPatch) -> None:
    from protofl import registry
    from protofl.technique import Option

    monkeypatch.setattr(registry, "options", lambda: {**OPTIONS, "lr": Option(0.5)})
    with pytest.raises(ConfigError, match="'lr'.*core field"):
        FederationConfig()
