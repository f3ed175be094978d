"""`run_simulation`: prepare the federation, run it in-process or over MQTT, return the report.

torch is imported here (the agents and the global predictor need it), never on the aggregator's
service path. With `spec.out_dir` the run leaves its deployable artifacts there (protofl/artifacts.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import platform
from collections.abc import Callable
from typing import Any

from broker_server.commands.report_cli import long_overruns
from broker_server.core.shell import Aggregator
from broker_server.simulation.deploy import write_run_artifacts
from broker_server.simulation.inprocess import run_inprocess
from broker_server.simulation.mqtt import run_over_mqtt
from broker_server.simulation.predictor import GlobalPredictor
from broker_server.simulation.report import Report
from broker_server.simulation.spec import TRANSPORTS, SimulationSpec, prepare
from protofl import privacy
from protofl.errors import ConfigError

log = logging.getLogger("protofl.simulate")


def run_simulation(
    spec: SimulationSpec,
    on_round: Callable[[dict[str, Any]], None] | None = None,
    *,
    on_finish: Callable[[Aggregator], None] | None = None,
    on_start: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Run a federation end to end and return the report dict.

    `on_round` gets each round's report row once its metrics are in; `on_finish` the aggregator once
    the run is over (its `model` is the final server state); `on_start` is called once the inputs are checked
    and the data loaded, before the first round (a progress display starts there). `spec.device` "auto" is
    resolved here, once, and the report records the device used."""
    if spec.transport not in TRANSPORTS:
        raise ConfigError(f"unknown transport '{spec.transport}'; use {' or '.join(TRANSPORTS)}")
    import torch  # the agents train with torch; imported here, not on the service path

    from broker_server.simulation.memory import keep_freed_memory

    keep_freed_memory()  # each batch's activations reuse the last one's pages (the system time, issue 48)

    from edge_agent.core.devices import resolve_device

    spec = dataclasses.replace(spec, device=resolve_device(spec.device))
    if spec.backend == "ray":
        from broker_server.simulation.ray_backend import check_ray, run_on_ray  # Ray: an optional extra

        check_ray(spec)  # before any data loads: the options, and that Ray is installed
    torch.set_num_threads(max(1, torch.get_num_threads()))
    fed_data = prepare(spec)
    cfg = fed_data.cfg
    public = fed_data.public_set()  # (trains the shared backbone, where the plan ships one)
    predictor = GlobalPredictor(cfg, fed_data.test, spec.device, backbone=None if public is None else public.backbone)
    report = Report(
        spec,
        cfg,
        fed_data.test.y,
        on_round=on_round,
        predictor=predictor.accuracy if predictor.kind is not None else None,
        predictor_info=(predictor.kind, predictor.reason),
    )
    initial = predictor.initial_params  # FedAvg: every device starts from the global model's weights
    if on_start is not None:
        on_start()
    ray_info = None
    if spec.backend == "ray":
        agg, ray_info = run_on_ray(spec, fed_data, report, initial)
    else:
        agg = (run_over_mqtt if spec.transport == "mqtt" else run_inprocess)(spec, fed_data, report, initial)
    if spec.out_dir is not None:
        write_run_artifacts(spec, fed_data, agg)
    if on_finish is not None:
        on_finish(agg)
    out = report.to_json(agg.dropped)
    if report.dp is not None:  # what the run spent, and why it stopped early where it did
        out["privacy"] = {
            **privacy.ledger(report.dp, len(report.records)),
            "stopped": agg.machine.state.stopped or None,
        }
    if ray_info is not None:
        out["ray"] = ray_info  # the rest is the in-process run's report
    out["machine"] = machine_info(torch)
    warn_long_overruns(out)
    return out


def machine_info(torch: Any) -> dict[str, Any]:
    """What the run's timings and float results depend on: torch's thread counts (they change the order of
    float sums, so two machines' runs differ slightly), the CPU model and count, torch's version."""
    return {
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "torch_version": str(torch.__version__),
        "cpu_model": cpu_model(),
        "cpus": os.cpu_count(),
    }


def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what the platform module says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def warn_long_overruns(report: dict[str, Any]) -> None:
    """Say in the log where this machine fell behind the time scale by more than a whole round."""
    late = long_overruns(report)
    if late:
        log.warning(
            "this machine could not keep up with --time-scale %g: %d upload(s) left later than the emulation "
            "asked by more than their whole round (those rounds' times are this machine's, not the devices'); "
            "run again with a lower --time-scale. First: %s",
            report["links"]["time_scale"],
            len(late),
            late[0],
        )
