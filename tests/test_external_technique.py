"""A technique from outside the package (tests/external_technique: FedProto with a coordinate-wise median
of prototypes) registers through the entry-point groups and runs through `simulate`; no file of the
package changes for it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

EXTERNAL = Path(__file__).parent / "external_technique"
FED: dict[str, Any] = dict(dataset="synthetic:n=600,n_test=200", clients=3, alpha=0.5, seed=3)


def _reload() -> None:
    from edge_agent.techniques import device_rules
    from protofl import registry

    registry.reload()
    device_rules.cache_clear()


@pytest.fixture
def installed() -> Iterator[None]:
    """The package on the path, as if pip-installed: its entry points are found by importlib.metadata."""
    sys.path.insert(0, str(EXTERNAL))
    _reload()
    try:
        yield
    finally:
        sys.path.remove(str(EXTERNAL))
        for name in [m for m in sys.modules if m == "median_proto" or m.startswith("median_proto.")]:
            del sys.modules[name]
        _reload()


@pytest.mark.slow
def test_simulate_runs_a_technique_installed_from_outside(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(EXTERNAL), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "run.json"
    proc = subprocess.run(
        [
            "protofl-server",
            "simulate",
            "--preset",
            "fedproto-median",
            "--dataset",
            FED["dataset"],
            "--clients",
            "3",
            "--rounds",
            "2",
            "--json",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(out.read_text())
    config = run["config"]
    assert run["preset"] == "fedproto-median" and config["techniques"]["median_proto"]["median_prototypes"] is True
    # a technique of another package names it, so that a device without it says what to install
    assert config["technique_packages"] == {"median_proto": "median-proto 0.1"}
    assert not run.get("dropped"), run.get("dropped")
    assert [r["clients"] for r in run["rounds"]] == [3, 3]
    assert run["rounds"][-1]["global_proto_acc"] is not None  # the median prototypes came back as targets


@pytest.mark.slow
def test_the_server_folds_the_median_and_devices_send_no_counts(installed: None, one_torch_thread: None) -> None:
    from broker_server.core.shell import Aggregator
    from broker_server.simulation import SimulationSpec, run_simulation
    from protofl.plan import RoundPlan
    from protofl.presets import make_config
    from protofl.transport import InProcessTransport
    from protofl.wire import ProtoUpload, decode_message

    assert RoundPlan.from_config(make_config("fedproto-median")).techniques == ("fedproto", "median_proto")
    uploads: list[ProtoUpload] = []
    publish = InProcessTransport.publish

    def spy(self: InProcessTransport, topic: str, payload: bytes, *, retain: bool = False, qos: int = 1) -> None:
        if payload and "/up/" in topic:
            _, msg = decode_message(payload)
            if isinstance(msg, ProtoUpload):
                uploads.append(msg)
        publish(self, topic, payload, retain=retain, qos=qos)

    finished: list[Aggregator] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(InProcessTransport, "publish", spy)
        run = run_simulation(SimulationSpec(preset="fedproto-median", rounds=1, **FED), on_finish=finished.append)
    assert not run["dropped"] and len(uploads) == FED["clients"]
    assert all(up.local is not None and up.local.counts is None for up in uploads)  # the device half acted
    model = finished[0].model
    tables = [up.local.table()[0] for up in uploads if up.local is not None]
    for c, got in model.rules.state_values()["prototypes"].items():
        rows = [t[c] for t in tables if c in t]
        # round 1's clip radius (1e4) bounds nothing here: the fold is the plain coordinate-wise median
        np.testing.assert_allclose(got, np.median(np.stack(rows).astype(np.float64), axis=0), rtol=1e-6)


def test_without_the_package_its_preset_is_unknown() -> None:
    from protofl.errors import ConfigError
    from protofl.presets import make_config

    with pytest.raises(ConfigError, match="fedproto-median"):
        make_config("fedproto-median")


def test_a_federation_config_names_only_the_techniques_it_uses(installed: None) -> None:
    from protofl.config import FederationConfig
    from protofl.presets import make_config

    cfg = make_config("tinyproto")
    wire = cfg.to_dict()
    assert list(wire["techniques"]) == ["fedproto", "cps"] and "technique_packages" not in wire
    assert "median_prototypes" not in json.dumps(wire)  # installed here, not used: nothing of it travels
    _reload_without_package()
    try:
        assert FederationConfig.from_dict(wire) == make_config("tinyproto")  # a device without it reads it
    finally:
        sys.path.insert(0, str(EXTERNAL))
        _reload()


def test_a_device_without_a_used_technique_is_told_which_package_to_install(installed: None) -> None:
    from protofl.config import FederationConfig
    from protofl.errors import ConfigError
    from protofl.presets import make_config

    wire = make_config("fedproto-median").to_dict()
    _reload_without_package()
    try:
        with pytest.raises(
            ConfigError,
            match=r"\['median_proto'\] that are not installed here: 'median_proto' comes "
            r"from median-proto 0.1: pip install 'median-proto==0.1'",
        ):
            FederationConfig.from_dict(wire)
    finally:
        sys.path.insert(0, str(EXTERNAL))
        _reload()


def test_an_option_of_a_technique_the_federation_does_not_use_is_refused() -> None:
    from protofl.errors import ConfigError
    from protofl.presets import make_config

    with pytest.raises(ConfigError, match=r"option\(s\) \['refine_steps'\] belong to technique\(s\) \['fedpagr'\]"):
        make_config("tinyproto", strict=True, refine_steps=3)
    assert make_config("tinyproto", refine_steps=3) == make_config("tinyproto")  # the Python API warns, drops it
    # the default, not the preset's own value of an option it switches off
    assert make_config("protofl", cps=False).mu == 1.5e-4


@pytest.mark.slow
def test_start_refuses_an_option_of_a_technique_its_federation_does_not_use(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "broker_server.cli",
            "start",
            "--insecure",
            "--preset",
            "tinyproto",
            "--set",
            "refine_steps=3",
            "--state-dir",
            str(tmp_path / "s"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "['refine_steps'] belong to technique(s) ['fedpagr']" in proc.stdout + proc.stderr
    assert not (tmp_path / "s").exists()  # refused before anything was made


def test_the_flat_config_of_an_earlier_server_is_still_read() -> None:
    from protofl.config import FederationConfig, canonical
    from protofl.presets import make_config

    cfg = make_config("tinyproto")
    flat = cfg.values()  # every installed option beside the core fields: the form before the scoped config
    assert "techniques" not in flat and flat["cps"] is True and "refine_steps" in flat
    assert FederationConfig.from_dict(flat) == cfg and canonical(flat) == cfg.to_dict()


def _reload_without_package() -> None:
    sys.path.remove(str(EXTERNAL))
    _reload()


def test_a_technique_that_does_not_load_is_named(tmp_path: Path) -> None:
    # A broken third-party package: named in a warning instead of a bare ImportError, and skipped (issue 55: it
    # cannot take down a federation that does not use it); one that names it is told why it cannot.
    dist = tmp_path / "broken-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[protofl.techniques]\nbroken = no_such_module:Broken\n")
    code = "from protofl.presets import make_config\nmake_config('fedproto')\nmake_config('fedproto', broken=True)\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    said = "technique 'broken' (broken = no_such_module:Broken (broken 0.1)) is installed but was skipped: it does not"
    assert proc.stderr.count(said) == 2, proc.stderr[-2000:]  # the warning, then the error of the config naming it
    assert "ConfigError: config 'broken'" in proc.stderr, proc.stderr[-2000:]


# -- a fleet where only the server has the package ----------------------------------------------------------------
REPO = Path(__file__).resolve().parents[1]
FLEET_DATA = "synthetic:n=300,n_test=20,size=12"
SMALL = [
    "--set",
    'archs=["mlp"]',
    "--set",
    "in_shape=[1,12,12]",
    "--set",
    "proto_dim=20",
    "--set",
    "batch_size=50",
    "--set",
    "adapter_rank=2",
]


class _Fleet:
    """`protofl-server start` (its own Mosquitto, --insecure on a free port) and two `protofl-edge join` processes
    that cannot import `package` (tests/external_technique); the server can when `with_package`. `preset`, `sets`
    (--set values) and `args` (more options of `start`) choose the federation (tests/test_plugin_isolation.py)."""

    def __init__(
        self,
        tmp: Path,
        rounds: int,
        package: Path = EXTERNAL,
        preset: str = "tinyproto",
        sets: tuple[str, ...] = (),
        args: tuple[str, ...] = (),
    ) -> None:
        from broker_server.ops.broker import free_port

        self.tmp, self.rounds, self.port = tmp, rounds, free_port()
        self.package, self.preset, self.sets, self.args = package, preset, sets, args
        self.server: subprocess.Popen[str] | None = None
        self.devices: list[subprocess.Popen[str]] = []
        self.log = tmp / "server.log"

    def env(self, with_package: bool) -> dict[str, str]:
        path = [str(self.package), str(REPO)] if with_package else [str(REPO)]
        return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONUNBUFFERED": "1"}

    def start(self, with_package: bool) -> None:
        cmd = [
            sys.executable,
            "-m",
            "broker_server.cli",
            "start",
            "--local-broker",
            "mosquitto",
            "--insecure",
            "--port",
            str(self.port),
            "--fed",
            "mixed",
            "--preset",
            self.preset,
            "--rounds",
            str(self.rounds),
            "--min-clients",
            "2",
            "--round-timeout",
            "120",
            "--offline-grace",
            "300",
            "--seed",
            "4",
            "--state-dir",
            str(self.tmp / "state"),
            *SMALL,
            *(arg for value in self.sets for arg in ("--set", value)),
            *self.args,
        ]
        with self.log.open("a") as out:
            self.server = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=self.env(with_package)
            )

    def join(self, devices: int = 2) -> None:
        self.devices = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "edge_agent.cli",
                    "join",
                    "--broker",
                    f"mqtt://127.0.0.1:{self.port}",
                    "--fed",
                    "mixed",
                    "--client-id",
                    f"dev-{i}",
                    "--data",
                    FLEET_DATA,
                    "--partition",
                    f"{i}/{devices}",
                    "--seed",
                    "4",
                    "--threads",
                    "1",
                    "--connect-timeout",
                    "60",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=self.env(False),
            )
            for i in range(devices)
        ]

    def rounds_done(self) -> int:
        path = self.tmp / "state" / "rounds.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def finish(self, timeout: float) -> list[str]:
        assert self.server is not None
        try:
            rc = self.server.wait(timeout)
            assert rc == 0, self.log.read_text()[-4000:]
            outs = [p.communicate(timeout=60)[0] for p in self.devices]
        finally:
            self.stop()
        for p, out in zip(self.devices, outs, strict=True):
            assert p.returncode == 0, out[-3000:]
        return outs

    def stop(self) -> None:
        for p in [self.server, *self.devices]:
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.slow
@pytest.mark.mosquitto
def test_devices_without_a_technique_the_server_has_installed_join_and_finish(tmp_path: Path) -> None:
    fleet = _Fleet(tmp_path, rounds=2)
    fleet.start(with_package=True)
    fleet.join()
    outs = fleet.finish(240)
    assert "federation 'mixed' finished: 2 rounds" in fleet.log.read_text()
    assert not any("median" in out for out in outs), outs  # nothing of the unused technique reached a device
    saved = json.loads((tmp_path / "state" / "aggregator" / "federation.json").read_text())["config"]
    assert sorted(saved["techniques"]) == ["cps", "fedproto"]


@pytest.mark.slow
@pytest.mark.mosquitto
def test_a_server_restarted_after_a_technique_was_installed_resumes_its_state_dir(tmp_path: Path) -> None:
    import time

    fleet = _Fleet(tmp_path, rounds=3)
    fleet.start(with_package=False)
    fleet.join()
    try:
        end = time.monotonic() + 180
        while fleet.rounds_done() < 1:  # wait for the first round to be journaled and checkpointed
            assert fleet.server is not None and fleet.server.poll() is None, fleet.log.read_text()[-4000:]
            assert time.monotonic() < end, "timed out waiting for round 1: " + fleet.log.read_text()[-4000:]
            time.sleep(0.2)
        assert fleet.server is not None
        fleet.server.kill()  # SIGKILL: the package is installed while the server is down
        fleet.server.wait()
        fleet.start(with_package=True)
    except BaseException:
        fleet.stop()
        raise
    fleet.finish(240)
    log = fleet.log.read_text()
    assert "resumed federation 'mixed'" in log and "cannot be resumed" not in log, log[-4000:]
    assert "federation 'mixed' finished: 3 rounds" in log, log[-4000:]
