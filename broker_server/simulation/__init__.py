"""A whole federation on one machine: the real agent and aggregator objects over a transport.

Modules: `spec` (what to run: SimulationSpec, resolve_config, prepare, Federation), `report` (the
per-round rows and the JSON report), `inprocess` and `mqtt` (the two runners), `run`
(run_simulation). When a round's row is shown is `broker_server.core.progress`, shared with the service.
"""

from broker_server.simulation.predictor import GlobalPredictor
from broker_server.simulation.report import Report
from broker_server.simulation.run import run_simulation
from broker_server.simulation.spec import (
    TRANSPORTS,
    Federation,
    SimulationSpec,
    client_id,
    prepare,
    resolve_config,
)

__all__ = [
    "TRANSPORTS",
    "Federation",
    "GlobalPredictor",
    "Report",
    "SimulationSpec",
    "client_id",
    "prepare",
    "resolve_config",
    "run_simulation",
]
