"""`simulate --transport inprocess`: every agent and the aggregator in this process, over an
`InProcessBroker` that delivers one message at a time (deterministic: the fast path of every test).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from broker_server.core.shell import Aggregator
from broker_server.simulation.deploy import DEVICE_ARTIFACTS, device_hook
from broker_server.simulation.report import Report, describe_drops
from broker_server.simulation.spec import FED, Federation, SimulationSpec
from protofl.transport import InProcessBroker, Transport

if TYPE_CHECKING:
    from edge_agent.core.agent import ClientData


def make_aggregator(
    spec: SimulationSpec, fed_data: Federation, report: Report, transport: Transport, initial_params: np.ndarray | None
) -> Aggregator:
    """The simulation's aggregator on `transport`, wired to the report (every backend runs this one)."""
    agg = Aggregator(
        fed_data.cfg,
        FED,
        transport,
        clock=time.time,
        initial_params=initial_params,
        public=fed_data.public_set(),
        expected_clients=spec.client_ids,
        policy=spec.policy(),
        on_round_end=lambda rec: report.on_round_end(rec, agg.model),
        on_metrics=report.on_metrics,
        limits=fed_data.limits(initial_params),
    )
    return agg


def client_data(fed_data: Federation, i: int, x_global: np.ndarray | None) -> ClientData:
    """Client i's share of the partition, normalised, with the official test set `x_global` (if given)."""
    from edge_agent.core.agent import ClientData

    train, test, part = fed_data.train, fed_data.test, fed_data.split.clients[i]
    return ClientData(
        x_train=train.normalized(part.train),
        y_train=train.y[part.train],
        x_test=train.normalized(part.test),
        y_test=train.y[part.test],
        x_global=x_global,
        y_global=test.y,
        mean=train.mean,
        std=train.std,
    )


def run_inprocess(
    spec: SimulationSpec, fed_data: Federation, report: Report, initial_params: np.ndarray | None
) -> Aggregator:
    """Run the federation to its last round; returns the aggregator (its `model` is the final state)."""
    from edge_agent.core.agent import EdgeAgent  # torch: only when a simulation runs
    from edge_agent.ops.local import LocalDevice

    cfg = fed_data.cfg
    x_test = fed_data.test.normalized()
    broker = InProcessBroker()
    agg = make_aggregator(spec, fed_data, report, broker.connect("server"), initial_params)
    devices = []
    deployable = device_hook(spec, cfg.num_classes)
    for i, cid in enumerate(spec.client_ids):
        data = client_data(fed_data, i, x_test)
        agent = EdgeAgent(
            cid,
            FED,
            data,
            arch=cfg.arch_for(i),
            device=spec.device,
            eval_every=spec.eval_every,
            test_every=spec.test_every,
            extractor=spec.extractor,
            artifacts_at=DEVICE_ARTIFACTS if deployable is not None else (),
        )
        devices.append(LocalDevice(agent, broker.connect(cid), deployable))
    agents = [d.agent for d in devices]
    agg.start()
    for d in devices:
        d.start()
    while not agg.finished:
        if broker.pump(1) == 0:
            drops = describe_drops(agg.dropped, {a.client_id: a.stats.dropped for a in agents})
            raise RuntimeError(f"simulation stalled in round {agg.round}: no messages left to deliver ({drops})")
        # Once nothing is in flight, every metrics message that will come has come.
        report.poll(time.time(), force=broker.pending == 0)
    broker.pump()
    report.poll(time.time(), force=True)
    return agg
