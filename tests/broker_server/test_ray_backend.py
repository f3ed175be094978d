"""`simulate --backend ray` on a two-node Ray cluster started here (Ray's own test cluster utility).

Each preset's Ray report is the in-process one (bytes exact, accuracies to 1e-5), whatever the number of
workers; a worker whose process is killed mid-round is started again, or its devices are reported lost,
and the run ends either way. One cluster for the module: starting Ray and its workers costs seconds.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from broker_server.simulation import SimulationSpec, run_simulation  # noqa: E402
from tests.pipelines import NO_FLOOR, as_cli_sets  # noqa: E402

# The step floor off (tests/pipelines.py NO_FLOOR): the backend's sameness is the point, not how much a device trains.
FED: dict[str, Any] = dict(
    dataset="synthetic:n=400,n_test=100", clients=3, alpha=0.5, rounds=2, seed=1, archs=("mlp",), overrides=NO_FLOOR
)
PRESETS = ["fedavg", "fedproto", "refprotofl", "tinyproto", "fedpagr", "protofl"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """Two nodes of two (logical) CPUs each, and this process connected to them (the workers persist across
    runs: each one is a process that imports torch, seconds on this machine)."""
    import torch
    from ray.cluster_utils import Cluster

    from broker_server.simulation import ray_backend

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers' agents: one thread each
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    try:
        c.add_node(num_cpus=2)
        c.wait_for_nodes()
        ray.init(address=c.address, configure_logging=False)
        yield c
    finally:
        ray.shutdown()
        ray_backend._IDLE.clear()
        c.shutdown()
        torch.set_num_threads(threads)


def _same(want: Any, got: Any, path: str = "") -> list[str]:
    """Where two reports differ: floats beyond 1e-5, anything else at all."""
    if isinstance(want, dict) and isinstance(got, dict):
        out = [f"{path}.{k}: only in one" for k in set(want) ^ set(got)]
        return out + [p for k in set(want) & set(got) for p in _same(want[k], got[k], f"{path}.{k}")]
    if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        return [p for i, (w, g) in enumerate(zip(want, got, strict=True)) for p in _same(w, g, f"{path}[{i}]")]
    if isinstance(want, float) and isinstance(got, float):
        return [] if math.isclose(want, got, rel_tol=0, abs_tol=1e-5) else [f"{path}: {want} != {got}"]
    return [] if want == got and type(want) is type(got) else [f"{path}: {want!r} != {got!r}"]


def _without_run_facts(report: dict[str, Any]) -> dict[str, Any]:
    report["totals"].pop("wall_s")
    report.pop("ray", None)
    report.pop("machine", None)  # the driver's machine and threads (the CLI's differ from this process's)
    return report


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_each_preset_on_two_nodes_gives_the_inprocess_report(preset: str, cluster: Any) -> None:
    want = run_simulation(SimulationSpec(preset=preset, **FED))
    got = run_simulation(SimulationSpec(preset=preset, backend="ray", **FED))
    assert got["ray"]["nodes"] == 2 and got["ray"]["workers"] == 3 and got["ray"]["restarts"] == {}
    assert got["totals"]["uplink_bytes"] > 0 and len(got["rounds"]) == 2
    assert _same(_without_run_facts(want), _without_run_facts(got)) == []


@pytest.mark.slow
def test_the_report_does_not_depend_on_the_number_of_workers(cluster: Any) -> None:
    fed = {**FED, "clients": 4}
    want = _without_run_facts(run_simulation(SimulationSpec(preset="protofl", **fed)))
    for workers in (1, 3):
        got = run_simulation(SimulationSpec(preset="protofl", backend="ray", ray_workers=workers, **fed))
        assert got["ray"]["workers"] == workers
        assert _same(want, _without_run_facts(got)) == []


def _kill_a_worker(row: dict[str, Any]) -> None:
    """After round 1's row (round 2 is open: its messages are with the workers or on their way), kill
    the process of one of the run's three workers (one device each)."""
    if row["round"] != 1:
        return
    names = sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("protofl-sim-worker-")
    )
    assert len(names) == 3  # the session's pool: this run's workers
    os.kill(ray.get(ray.get_actor(names[0]).pid.remote()), signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_worker_is_started_again_and_the_run_completes(cluster: Any) -> None:
    report = run_simulation(
        SimulationSpec(preset="protofl", backend="ray", **{**FED, "rounds": 3}), on_round=_kill_a_worker
    )
    assert [r["round"] for r in report["rounds"]] == [1, 2, 3]
    assert all(r["clients"] == 3 for r in report["rounds"])
    assert len(report["ray"]["restarts"]) == 1 and set(report["ray"]["restarts"].values()) == {1}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_worker_killed_with_no_restart_left_ends_the_run_naming_its_devices(cluster: Any) -> None:
    from broker_server.simulation.ray_backend import DevicesLost

    spec = SimulationSpec(preset="protofl", backend="ray", ray_max_restarts=0, **{**FED, "rounds": 3})
    with pytest.raises(DevicesLost, match=r"client-00\d.* lost with their Ray worker"):
        run_simulation(spec, on_round=_kill_a_worker)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_cli_joins_a_running_cluster_by_its_address(cluster: Any, tmp_path: Any) -> None:
    """What docs/how-to/ray.md shows: `ray start --head` elsewhere, then `simulate --backend ray --ray-address ...`."""
    out = tmp_path / "r.json"
    args = [
        "--preset",
        "tinyproto",
        "--dataset",
        FED["dataset"],
        "--clients",
        "3",
        "--rounds",
        "2",
        "--seed",
        "1",
        "--arch",
        "mlp",
        *as_cli_sets(NO_FLOOR),  # as FED
    ]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "broker_server.cli",
            "simulate",
            *args,
            "--backend",
            "ray",
            "--ray-address",
            cluster.address,
            "--ray-workers",
            "1",
            "--json",
            str(out),
            "-q",
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["ray"]["address"] == cluster.address and got["ray"]["nodes"] == 2
    want = run_simulation(SimulationSpec(preset="tinyproto", **{**FED, "archs": ("mlp",)}))
    assert _same(_without_run_facts(want), _without_run_facts(got)) == []


@pytest.mark.slow
def test_out_leaves_the_same_artifacts_as_inprocess(cluster: Any, tmp_path: Any) -> None:
    """--out: each worker writes its devices' artifacts (here the nodes share this file system)."""
    for backend in ("local", "ray"):
        run_simulation(SimulationSpec(preset="tinyproto", backend=backend, out_dir=str(tmp_path / backend), **FED))
    files = {
        b: sorted(str(p.relative_to(tmp_path / b)) for p in (tmp_path / b).rglob("*") if p.is_file())
        for b in ("local", "ray")
    }
    assert files["ray"] == files["local"]
    assert {f"devices/client-00{i}" for i in range(3)} <= {str(Path(f).parent) for f in files["ray"]}
    tables = [p for p in files["ray"] if p.startswith("devices/client-000/") and p.endswith(".npz")]
    assert tables and all((tmp_path / "ray" / p).read_bytes() == (tmp_path / "local" / p).read_bytes() for p in tables)
