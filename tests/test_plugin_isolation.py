"""Plug-ins that cannot take the server down (issue 55; docs/techniques.md, "Techniques from other packages").

tests/plugin_techniques holds three third-party techniques as pip would install them: `clash_mu` declares `mu`,
which CPS declares; `bad_check`'s check raises on every config; `server_only` is a server rule alone, declared
`device_free`. The first two are named in a warning and skipped; every built-in preset still runs beside them. The
third is active in a real `start` + `join` federation whose devices never installed it. A device that refuses a
federation is counted per member in `status` and named in the server's log.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from protofl.errors import ConfigError

PLUGINS = Path(__file__).parent / "plugin_techniques"
REPO = Path(__file__).resolve().parents[1]
BUILT_IN = ("fedavg", "fedproto", "refprotofl", "tinyproto", "fedpagr", "protofl")
SMALL: dict[str, Any] = dict(archs=["mlp"], in_shape=[1, 12, 12], proto_dim=20, adapter_rank=2, batch_size=50)


@pytest.fixture
def browser() -> Iterator[object]:
    from tests.broker_server.browser import chromium

    yield from chromium()


def _reload() -> None:
    from edge_agent.techniques import device_rules
    from protofl import registry

    registry.reload()
    device_rules.cache_clear()


@pytest.fixture
def installed() -> Iterator[None]:
    """The three packages on the path, as if pip-installed: importlib.metadata finds their entry points."""
    sys.path.insert(0, str(PLUGINS))
    _reload()
    try:
        yield
    finally:
        sys.path.remove(str(PLUGINS))
        for name in [m for m in sys.modules if m.split(".")[0] in ("clash_mu", "bad_check", "server_only")]:
            del sys.modules[name]
        _reload()


def _named(name: str, value: Any) -> dict[str, Any]:
    """A qualified option as keyword arguments (`make_config("tinyproto", **_named("cps.mu", 0.5))`)."""
    return {name: value}


def _warned(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


def test_a_clashing_and_a_failing_technique_are_named_once_and_skipped(
    installed: None, caplog: pytest.LogCaptureFixture
) -> None:
    from protofl import registry
    from protofl.presets import make_config

    with caplog.at_level(logging.WARNING, logger="protofl.registry"):
        names = [t.name for t in registry.techniques()]
        for preset in BUILT_IN:
            make_config(preset)
    said = _warned(caplog)
    clash = "technique 'clash_mu' (clash_mu = clash_mu:Technique (clash-mu 0.1)) is installed but was skipped: "
    assert clash + "its option 'mu' is declared by 'cps' too" in said, said
    bad = "technique 'bad_check' (bad_check = bad_check:Technique (bad-check 0.1)) is installed but was skipped: "
    assert bad + "its check fails on the default config, where it is off: RuntimeError: bad_check is broken" in said
    # once, however many configs are made
    assert said.count("technique 'clash_mu'") == 1 and said.count("technique 'bad_check'") == 1
    assert "clash_mu" not in names and "bad_check" not in names and "server_only" in names
    # bare `mu` is still CPS's, as in every config and preset written before (the wire form is unchanged)
    assert make_config("tinyproto", mu=0.25).to_dict() == make_config("tinyproto", **_named("cps.mu", 0.25)).to_dict()
    assert make_config("tinyproto").to_dict()["techniques"]["cps"]["mu"] == "auto"
    # a federation that names a skipped technique is told why it cannot have it
    with pytest.raises(ConfigError, match=r"config 'clash_mu\.mu': technique 'clash_mu' .* was skipped: its option"):
        make_config("tinyproto", **_named("clash_mu.mu", 1.0))
    with pytest.raises(ConfigError, match=r"config 'bad_check': technique 'bad_check' .* was skipped: its check"):
        make_config("fedproto", bad_check=True)


@pytest.mark.slow
def test_every_built_in_preset_runs_beside_them(installed: None, one_torch_thread: None) -> None:
    from broker_server.simulation import SimulationSpec, run_simulation

    for preset in BUILT_IN:
        run = run_simulation(
            SimulationSpec(
                preset=preset,
                dataset="synthetic:n=200,n_test=40,size=12",
                clients=2,
                rounds=1,
                seed=1,
                overrides=dict(SMALL, public_per_class=2),
            )
        )
        assert not run["dropped"] and [r["clients"] for r in run["rounds"]] == [2], (preset, run["dropped"])
        assert "clash_mu" not in run["config"]["techniques"] and "bad_check" not in run["config"]["techniques"]


def test_options_are_named_as_their_techniques(tmp_path: Path) -> None:
    from protofl.config import FederationConfig
    from protofl.presets import make_config

    want = make_config("tinyproto", mu=1.5e-4)
    assert make_config("tinyproto", **_named("cps.mu", 1.5e-4)) == want  # the Python API
    assert want.replace(**_named("cps.mu", 0.5)).mu == 0.5
    assert FederationConfig(cps=True, **_named("cps.cps_s", 3)).cps_s == 3
    quoted = tmp_path / "quoted.toml"
    quoted.write_text('[federation]\n"cps.mu" = 1.5e-4\n')
    table = tmp_path / "table.toml"
    table.write_text("[federation.cps]\nmu = 1.5e-4\n")
    assert make_config("tinyproto", str(quoted)) == want and make_config("tinyproto", str(table)) == want
    assert want.to_dict()["techniques"]["cps"]["mu"] == 1.5e-4  # the wire form: scoped as it always was
    with pytest.raises(ConfigError, match=r"'mu' is given twice \(as 'mu' and 'cps.mu'\)"):
        make_config("tinyproto", mu=1.0, **_named("cps.mu", 2.0))
    with pytest.raises(ConfigError, match=r"technique 'cps' has no option 'lr'; its options: \['cps', 'cps_s', 'mu'"):
        make_config("tinyproto", **_named("cps.lr", 1.0))
    with pytest.raises(ConfigError, match=r"names technique 'nope', which is not installed; installed: fedavg"):
        make_config("tinyproto", **_named("nope.mu", 1.0))


def test_an_ambiguous_bare_name_names_the_candidates(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two loaded techniques never share an option name (a third-party one that would is skipped), so the case is
    # made by hand: the resolver still says which names to write.
    from protofl import registry
    from protofl.technique import Technique, number

    class One(Technique):
        name = "one"
        options = {"mu": number("mu", 1.0)}

    class Two(Technique):
        name = "two"
        options = {"mu": number("mu", 1.0)}

    found = registry._Installed({"one": (One(), None), "two": (Two(), None)}, {})
    monkeypatch.setattr(registry, "_found", lambda: found)
    with pytest.raises(
        ConfigError, match=r"'mu' is declared by \['one', 'two'\]: name the one you mean as one.mu or two.mu"
    ):
        registry.option_name("mu")
    assert registry.option_name("two.mu") == "mu"


def test_start_takes_a_qualified_set(tmp_path: Path) -> None:
    from broker_server.cli_common import parse_sets
    from protofl.presets import make_config

    sets = parse_sets(["cps.mu=1.5e-4", "scaling=true"])
    assert sets == {"cps.mu": 1.5e-4, "scaling": True}
    assert make_config("tinyproto", strict=True, **sets).mu == 1.5e-4


def test_a_device_free_technique_is_read_by_a_device_without_it(installed: None) -> None:
    from edge_agent.techniques import rules_for
    from protofl.config import FederationConfig
    from protofl.plan import RoundPlan
    from protofl.presets import make_config
    from protofl.wire import Config

    cfg = make_config("tinyproto", server_only=True, **_named("server_only.server_only_tag", "x"))
    wire = json.loads(json.dumps(cfg.to_dict()))
    assert wire["device_free"] == ["server_only"] and wire["techniques"]["server_only"]["server_only_tag"] == "x"
    assert "device_free" not in make_config("tinyproto").to_dict()  # a federation without one sends what it sent
    # where it is installed (the server, the simulator) it has no device rule, and needs none
    plan = RoundPlan.from_config(cfg)
    assert "server_only" in plan.techniques
    assert [r.name for r in rules_for(cfg, plan, Config(preset="tinyproto", params=wire))] == ["fedproto", "cps"]
    sys.path.remove(str(PLUGINS))
    _reload()
    try:
        device = FederationConfig.from_dict(wire)  # a device that never installed it
        assert device.techniques == ("fedproto", "cps") and device == make_config("tinyproto")
        # ... but a technique that is not device-free still needs its package
        with pytest.raises(ConfigError, match=r"technique\(s\) \['server_only'\] that are not installed here"):
            FederationConfig.from_dict({k: v for k, v in wire.items() if k != "device_free"})
    finally:
        sys.path.insert(0, str(PLUGINS))
        _reload()


# -- real fleets: `protofl-server start` and `protofl-edge join` processes over Mosquitto ----------------------------
@pytest.mark.slow
@pytest.mark.mosquitto
def test_a_device_free_technique_runs_with_devices_that_never_installed_it(tmp_path: Path) -> None:
    from tests.test_external_technique import _Fleet

    # The server has the three packages (two of them skipped with a warning); the devices have none.
    sets = ("server_only=true", "server_only.server_only_tag=fleet")
    fleet = _Fleet(tmp_path, rounds=2, package=PLUGINS, sets=sets)
    fleet.start(with_package=True)
    fleet.join()
    outs = fleet.finish(240)
    log = fleet.log.read_text()
    assert "federation 'mixed' finished: 2 rounds" in log, log[-4000:]
    assert "technique 'clash_mu'" in log and "technique 'bad_check'" in log  # named, skipped, harmless
    assert "server_only[fleet] saw phase train open (2 so far)" in log, log[-4000:]  # its server rule acted
    saved = json.loads((tmp_path / "state" / "aggregator" / "federation.json").read_text())["config"]
    assert saved["techniques"]["server_only"] == {"server_only": True, "server_only_tag": "fleet"}
    assert saved["device_free"] == ["server_only"]
    assert not any("server_only" in out and "not installed" in out for out in outs), outs


@pytest.mark.slow
@pytest.mark.mosquitto
def test_a_device_that_refuses_the_federation_is_counted_in_status_the_page_and_the_log(
    tmp_path: Path, browser: Any
) -> None:
    from broker_server.ops.broker import free_port
    from tests.broker_server.browser import eventually
    from tests.test_external_technique import EXTERNAL, _Fleet

    # The server runs a technique (median_proto, not device-free) that the device lacks: before this change the server
    # waited at 0 members and only device-logs/ said why.
    ui_port = free_port()
    fleet = _Fleet(tmp_path, rounds=1, package=EXTERNAL, preset="fedproto-median", args=("--ui-port", str(ui_port)))
    fleet.start(with_package=True)
    fleet.join(devices=1)
    try:
        status = tmp_path / "state" / "status.json"
        end = time.monotonic() + 180
        while True:
            refusals = json.loads(status.read_text()).get("refusals", []) if status.exists() else []
            if refusals or time.monotonic() > end:
                break
            time.sleep(0.5)
        assert len(refusals) == 1 and refusals[0]["member"] == "dev-0" and refusals[0]["times"] == 1, refusals
        assert (
            refusals[0]["reason"].startswith("cannot join federation 'mixed'")
            and "median_proto" in refusals[0]["reason"]
        )
        log = fleet.log.read_text()
        assert "device dev-0: cannot join federation 'mixed'" in log, log[-4000:]
        shown = subprocess.run(
            [sys.executable, "-m", "broker_server.cli", "status", "--state-dir", str(tmp_path / "state")],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "COLUMNS": "200"},
        )
        assert "refused by 1 member(s):" in shown.stdout and "refused: dev-0 (1x): cannot join" in shown.stdout, (
            shown.stdout + shown.stderr
        )
        browser.get(f"http://127.0.0.1:{ui_port}/")
        eventually(lambda: "dev-0 (1x): cannot join" in browser.find_element("id", "refusals").text, 30, "the page")
        assert "refused by 1 member(s)" in browser.find_element("id", "refusals").text
    finally:
        fleet.stop()
    out = fleet.devices[0].communicate(timeout=60)[0]
    assert "unusable federation config" in out and "median_proto" in out, out[-3000:]  # it waits for another
