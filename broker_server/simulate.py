"""A whole federation on one machine: the real agent and aggregator objects over a transport.

The report's accuracies come from the agents' `metrics` messages; bytes come from the encoded
messages the aggregator received and published. torch is imported here (the agents need it), never
on the aggregator's service path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from broker_server.aggregator import Aggregator, RoundRecord
from broker_server.stages import ServerModel
from edge_agent.local_data import federation_split, limit_train
from protofl.config import FederationConfig
from protofl.data import Dataset, FederatedSplit, load_dataset
from protofl.errors import ConfigError
from protofl.presets import make_config
from protofl.transport import InProcessBroker
from protofl.transport.broker_url import BrokerOptions
from protofl.wire import Metrics, PublicSet


@dataclass
class SimulationSpec:
    preset: str = "protofl"
    dataset: str = "synthetic"
    data_dir: str | None = None
    clients: int = 5
    alpha: float = 0.5
    rounds: int = 3
    seed: int = 0
    archs: tuple[str, ...] | None = None
    transport: str = "inprocess"  # or "mqtt": a real broker, agents as separate processes
    broker: BrokerOptions | None = None  # mqtt: None = start a local broker (mosquitto, else amqtt)
    broker_kind: str = "auto"  # the local broker: auto | mosquitto | amqtt
    agents: str = "process"  # mqtt: "process" (protofl-edge join per client) or "thread" (tests)
    timeout: float | None = None  # mqtt: give up after this many seconds
    config_file: str | None = None
    train_limit: int | None = None  # use a seeded random subset of N training samples (faster runs)
    test_limit: int | None = None  # evaluate global/ensemble accuracy on the first N test samples
    eval_every: int = 1
    extractor: str = "torch"  # agents extract prototypes with torch or onnxruntime ("onnx")
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass
class Federation:
    """The data side of a simulation: identical for every preset given (dataset, N, alpha, seed)."""

    train: Dataset
    test: Dataset
    split: FederatedSplit
    cfg: FederationConfig

    def public_set(self) -> PublicSet | None:
        if not self.cfg.erpa or len(self.split.public) == 0:
            return None
        idx = self.split.public
        return PublicSet(x=self.train.x[idx], y=self.train.y[idx].astype(np.int64),
                         classes=sorted(int(c) for c in np.unique(self.train.y[idx])))


def resolve_config(spec: SimulationSpec, num_classes: int, in_shape: tuple[int, ...]) -> FederationConfig:
    """The config a simulation of `spec` runs with; the dataset decides the classes and input shape."""
    overrides = dict(spec.overrides)
    overrides.update(rounds=spec.rounds, seed=spec.seed, num_classes=num_classes, in_shape=tuple(in_shape),
                     min_clients=spec.clients)
    if spec.archs:
        overrides["archs"] = tuple(spec.archs)
    return make_config(spec.preset, spec.config_file, **overrides)


def prepare(spec: SimulationSpec) -> Federation:
    if spec.clients < 1:
        raise ConfigError(f"--clients must be >= 1, got {spec.clients}")
    if not spec.alpha > 0:
        raise ConfigError(f"--alpha must be > 0, got {spec.alpha}")
    if spec.extractor not in ("torch", "onnx"):
        raise ConfigError(f"--extractor must be torch or onnx, got '{spec.extractor}'")
    train, test = load_dataset(spec.dataset, data_dir=spec.data_dir, seed=spec.seed)
    train = limit_train(train, spec.train_limit, spec.seed)
    cfg = resolve_config(spec, train.num_classes, tuple(train.in_shape))
    # The public set is carved out for every preset, so that the client partition is the same
    # whichever method runs on it.
    split = federation_split(train, spec.clients, spec.alpha, spec.seed, cfg)  # what --partition i/N loads
    if spec.test_limit is not None:
        test = test.subset(np.arange(min(spec.test_limit, len(test))))
    return Federation(train, test, split, cfg)


class Report:
    """Collects per-round metrics and byte counts and renders the JSON report."""

    def __init__(self, spec: SimulationSpec, cfg: FederationConfig, test_labels: np.ndarray) -> None:
        self.spec = spec
        self.cfg = cfg
        self.test_labels = test_labels
        self.metrics: dict[int, dict[str, Metrics]] = {}
        self.ens: dict[int, np.ndarray] = {}
        self.global_model_acc: dict[int, float] = {}
        self.metrics_bytes: dict[int, int] = {}
        self.records: list[RoundRecord] = []
        self.started = time.perf_counter()

    def on_metrics(self, client: str, round_: int, msg: Metrics, nbytes: int) -> None:
        self.metrics.setdefault(round_, {})[client] = msg
        self.metrics_bytes[round_] = self.metrics_bytes.get(round_, 0) + nbytes
        if msg.probs is not None and msg.probs.shape[0] == len(self.test_labels):
            acc = self.ens.get(round_)
            self.ens[round_] = msg.probs.astype(np.float64) if acc is None else acc + msg.probs

    def round_row(self, rec: RoundRecord) -> dict[str, Any]:
        ms = list(self.metrics.get(rec.round, {}).values())
        local = global_ = ens = None
        if ms:
            n_local = sum(m.n_local for m in ms)
            local = sum(m.correct_local for m in ms) / n_local if n_local else None
            tested = [m.correct_test / m.n_test for m in ms if m.n_test]
            global_ = float(np.mean(tested)) if tested else None
        if self.cfg.federate == "full":
            # FedAvg: global accuracy is the aggregated model's; it has no ensemble.
            global_ = self.global_model_acc.get(rec.round, global_)
        elif rec.round in self.ens and len(self.test_labels):
            ens = float((self.ens[rec.round].argmax(1) == self.test_labels).mean())
        return {
            "round": rec.round,
            "local_acc": local,
            "global_acc": global_,
            "ensemble_acc": ens,
            "uplink_bytes": rec.uplink_bytes,
            "downlink_bytes": rec.downlink_bytes,
            "clients": len(rec.clients),
            "metrics_bytes": self.metrics_bytes.get(rec.round, 0),  # evaluation traffic, not uplink
            "closed_by": rec.closed_by,
        }

    def to_json(self, dropped: dict[str, int]) -> dict[str, Any]:
        rows = [self.round_row(r) for r in self.records]
        return {
            "preset": self.cfg.preset,
            "config": self.cfg.to_dict(),
            "simulation": {"dataset": self.spec.dataset, "clients": self.spec.clients, "alpha": self.spec.alpha,
                           "seed": self.spec.seed, "transport": self.spec.transport,
                           "test_samples": int(len(self.test_labels))},
            "rounds": rows,
            "totals": {
                "uplink_bytes": int(sum(r["uplink_bytes"] for r in rows)),
                "downlink_bytes": int(sum(r["downlink_bytes"] for r in rows)),
                "wall_s": round(time.perf_counter() - self.started, 3),
            },
            "dropped": dict(dropped),
        }


TRANSPORTS = ("inprocess", "mqtt")


class GlobalModelEval:
    """FedAvg's global accuracy: the aggregated parameter vector evaluated on the test set (torch)."""

    def __init__(self, cfg: FederationConfig, test: Dataset) -> None:
        from edge_agent import params as model_params
        from edge_agent.models import build_model

        self.model = build_model(cfg.archs[0], cfg.in_shape, cfg.num_classes, cfg.proto_dim, cfg.adapter_rank,
                                 seed=cfg.seed)
        self.initial_params = model_params.full_vector(self.model)
        self.x, self.y = test.normalized(), test.y

    def accuracy(self, params: np.ndarray) -> float:
        import torch

        from edge_agent import params as model_params
        from edge_agent import trainer

        model_params.load_full_vector(self.model, params)
        probs = trainer.predict_proba(self.model, torch.from_numpy(self.x))
        return float((probs.argmax(1) == self.y).mean()) if len(self.y) else 0.0


def run_simulation(spec: SimulationSpec, on_round: Callable[[dict[str, Any]], None] | None = None, *,
                   on_finish: Callable[[Aggregator], None] | None = None) -> dict[str, Any]:
    """Run a federation end to end and return the report dict.

    `on_round` gets each round's report row; `on_finish` the aggregator once the run is over (its
    `model` is the final server state)."""
    if spec.transport not in TRANSPORTS:
        raise ConfigError(f"unknown transport '{spec.transport}'; use {' or '.join(TRANSPORTS)}")
    import torch  # the agents train with torch; imported here, not on the service path

    torch.set_num_threads(max(1, torch.get_num_threads()))
    fed_data = prepare(spec)
    cfg = fed_data.cfg
    report = Report(spec, cfg, fed_data.test.y)
    evaluator = GlobalModelEval(cfg, fed_data.test) if cfg.federate == "full" else None

    def round_end(rec: RoundRecord, model: ServerModel) -> None:
        if evaluator is not None and model.params is not None:
            report.global_model_acc[rec.round] = evaluator.accuracy(model.params)
        report.records.append(rec)

    initial = evaluator.initial_params if evaluator is not None else None
    if spec.transport == "mqtt":
        from broker_server.simulate_mqtt import run_over_mqtt

        agg = run_over_mqtt(spec, fed_data, report, initial, round_end, on_round)
    else:
        agg = _run_inprocess(spec, fed_data, report, initial, round_end, on_round)
    if on_finish is not None:
        on_finish(agg)
    return report.to_json(agg.dropped)


def _run_inprocess(spec: SimulationSpec, fed_data: Federation, report: Report, initial_params: np.ndarray | None,
                   round_end: Callable[[RoundRecord, ServerModel], None],
                   on_round: Callable[[dict[str, Any]], None] | None) -> Aggregator:
    from edge_agent.agent import ClientData, EdgeAgent

    cfg, train, test, split = fed_data.cfg, fed_data.train, fed_data.test, fed_data.split
    x_test = test.normalized()
    broker = InProcessBroker()
    fed = "sim"
    client_ids = [f"client-{i:03d}" for i in range(spec.clients)]
    agg = Aggregator(cfg, fed, broker.connect("server"), clock=time.time, initial_params=initial_params,
                     public=fed_data.public_set(), expected_clients=client_ids,
                     on_round_end=lambda rec: round_end(rec, agg.model), on_metrics=report.on_metrics)
    agents = []
    for i, cid in enumerate(client_ids):
        part = split.clients[i]
        data = ClientData(x_train=train.normalized(part.train), y_train=train.y[part.train],
                          x_test=train.normalized(part.test), y_test=train.y[part.test],
                          x_global=x_test, y_global=test.y, mean=train.mean, std=train.std)
        agents.append(EdgeAgent(cid, fed, broker.connect(cid), data, arch=cfg.arch_for(i),
                                eval_every=spec.eval_every, extractor=spec.extractor))
    agg.start()
    for a in agents:
        a.start()
    done_rounds = 0
    while not agg.finished:
        if broker.pump(1) == 0:
            raise RuntimeError(f"simulation stalled in round {agg.round}: no messages left to deliver "
                               f"(dropped: {agg.dropped})")
        while done_rounds < len(report.records) and broker.pending == 0 or (
                done_rounds < len(report.records) - 1):
            # metrics of a round arrive after its last upload; report a round once they are in
            row = report.round_row(report.records[done_rounds])
            done_rounds += 1
            if on_round is not None:
                on_round(row)
    broker.pump()
    while done_rounds < len(report.records):
        if on_round is not None:
            on_round(report.round_row(report.records[done_rounds]))
        done_rounds += 1
    return agg
