"""`run_simulation`: prepare the federation, run it in-process or over MQTT, return the report.

torch is imported here (the agents and FedAvg's global model need it), never on the aggregator's
service path.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from broker_server.report_cli import long_overruns
from broker_server.shell import Aggregator
from broker_server.simulation.inprocess import run_inprocess
from broker_server.simulation.mqtt import run_over_mqtt
from broker_server.simulation.report import Report
from broker_server.simulation.spec import TRANSPORTS, SimulationSpec, prepare
from protofl.config import FederationConfig
from protofl.data import Dataset
from protofl.errors import ConfigError

log = logging.getLogger("protofl.simulate")


class GlobalModelEval:
    """FedAvg's global accuracy: the aggregated parameter vector evaluated on the test set (torch)."""

    def __init__(self, cfg: FederationConfig, test: Dataset, device: str = "cpu") -> None:
        import torch

        from edge_agent import params as model_params
        from edge_agent.models import build_model

        self.model = build_model(cfg.archs[0], cfg.in_shape, cfg.num_classes, cfg.proto_dim, cfg.adapter_rank,
                                 seed=cfg.seed)
        self.initial_params = model_params.full_vector(self.model)
        self.model.to(device)
        self.x = torch.from_numpy(np.ascontiguousarray(test.normalized(), dtype=np.float32)).to(device)
        self.y = test.y

    def accuracy(self, params: np.ndarray, batch_size: int = 512) -> float:
        import torch

        from edge_agent import params as model_params

        model_params.load_full_vector(self.model, params)
        self.model.eval()
        correct = 0
        with torch.inference_mode():
            for i in range(0, len(self.y), batch_size):
                pred = self.model.head(self.model.features(self.x[i:i + batch_size])).argmax(1)
                correct += int((pred.cpu().numpy() == self.y[i:i + batch_size]).sum())
        return correct / len(self.y) if len(self.y) else 0.0


def run_simulation(spec: SimulationSpec, on_round: Callable[[dict[str, Any]], None] | None = None, *,
                   on_finish: Callable[[Aggregator], None] | None = None) -> dict[str, Any]:
    """Run a federation end to end and return the report dict.

    `on_round` gets each round's report row once its metrics are in; `on_finish` the aggregator once
    the run is over (its `model` is the final server state). `spec.device` "auto" is resolved here,
    once, and the report records the device used."""
    if spec.transport not in TRANSPORTS:
        raise ConfigError(f"unknown transport '{spec.transport}'; use {' or '.join(TRANSPORTS)}")
    import torch  # the agents train with torch; imported here, not on the service path

    from edge_agent.devices import resolve_device

    spec = dataclasses.replace(spec, device=resolve_device(spec.device))
    torch.set_num_threads(max(1, torch.get_num_threads()))
    fed_data = prepare(spec)
    cfg = fed_data.cfg
    evaluator = GlobalModelEval(cfg, fed_data.test, spec.device) if cfg.federate == "full" else None
    report = Report(spec, cfg, fed_data.test.y, on_round=on_round,
                    evaluate=evaluator.accuracy if evaluator is not None else None)
    initial = evaluator.initial_params if evaluator is not None else None
    runner = run_over_mqtt if spec.transport == "mqtt" else run_inprocess
    agg = runner(spec, fed_data, report, initial)
    if on_finish is not None:
        on_finish(agg)
    out = report.to_json(agg.dropped)
    warn_long_overruns(out)
    return out


def warn_long_overruns(report: dict[str, Any]) -> None:
    """Say in the log where this machine fell behind the time scale by more than a whole round."""
    late = long_overruns(report)
    if late:
        log.warning("this machine could not keep up with --time-scale %g: %d upload(s) left later than the emulation "
                    "asked by more than their whole round (those rounds' times are this machine's, not the devices'); "
                    "run again with a lower --time-scale. First: %s", report["links"]["time_scale"], len(late), late[0])
