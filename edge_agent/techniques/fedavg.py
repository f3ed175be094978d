"""FedAvg's device half: the parameter vector this device uploads (the whole model, or the adapter).

Loading the round message's vector is the agent's (it holds the model); this rule says what goes up: the vector of
what the federation shares (edge_agent/training/param_federation.py).
The server half is protofl/algorithms/fedavg.py.
"""

from __future__ import annotations

import numpy as np

from edge_agent.techniques import DeviceContext, DeviceRule
from edge_agent.training.param_federation import param_federation


class FedAvgDevice(DeviceRule):
    name = "fedavg"

    def vector(self, ctx: DeviceContext) -> np.ndarray | None:
        return param_federation(self.plan.federate).vector(ctx.model)
