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

import numpy as np
import pytest

EXTERNAL = Path(__file__).parent / "external_technique"
FED = dict(dataset="synthetic:n=600,n_test=200", clients=3, alpha=0.5, seed=3)


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
    proc = subprocess.run(["protofl-server", "simulate", "--preset", "fedproto-median", "--dataset", FED["dataset"],
                           "--clients", "3", "--rounds", "2", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(out.read_text())
    assert run["preset"] == "fedproto-median" and run["config"]["median_prototypes"] is True
    assert not run.get("dropped"), run.get("dropped")
    assert [r["clients"] for r in run["rounds"]] == [3, 3]
    assert run["rounds"][-1]["global_proto_acc"] is not None  # the median prototypes came back as targets


@pytest.mark.slow
def test_the_server_folds_the_median_and_devices_send_no_counts(installed: None, one_torch_thread: None) -> None:
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

    box: dict[str, object] = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(InProcessTransport, "publish", spy)
        run = run_simulation(SimulationSpec(preset="fedproto-median", rounds=1, **FED),
                             on_finish=lambda a: box.setdefault("agg", a))
    assert not run["dropped"] and len(uploads) == FED["clients"]
    assert all(up.local is not None and up.local.counts is None for up in uploads)  # the device half acted
    model = box["agg"].model  # type: ignore[attr-defined]
    tables = [up.local.table()[0] for up in uploads if up.local is not None]
    for c, got in model.prototypes.items():
        rows = [t[c] for t in tables if c in t]
        # round 1's clip radius (1e4) bounds nothing here: the fold is the plain coordinate-wise median
        np.testing.assert_allclose(got, np.median(np.stack(rows).astype(np.float64), axis=0), rtol=1e-6)


def test_without_the_package_its_preset_is_unknown() -> None:
    from protofl.errors import ConfigError
    from protofl.presets import make_config

    with pytest.raises(ConfigError, match="fedproto-median"):
        make_config("fedproto-median")


def test_a_technique_that_does_not_load_is_named(tmp_path: Path) -> None:
    # A broken third-party package: the error names its entry point instead of a bare ImportError.
    dist = tmp_path / "broken-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[protofl.techniques]\nbroken = no_such_module:Broken\n")
    code = "from protofl.presets import make_config\nmake_config('fedproto')\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "technique 'broken = no_such_module:Broken' (entry point group protofl.techniques) does not load" \
        in proc.stderr, proc.stderr[-2000:]
