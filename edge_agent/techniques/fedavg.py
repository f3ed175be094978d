"""FedAvg's device half: the parameter vector this device uploads (the whole model, or the adapter).

Loading the round message's vector is the agent's (it holds the model); this rule says what goes up.
The server half is protofl/algorithms/fedavg.py.
"""

from __future__ import annotations

import numpy as np

from edge_agent import params as model_params
from edge_agent.techniques import DeviceContext, DeviceRule


class FedAvgDevice(DeviceRule):
    name = "fedavg"

    def vector(self, ctx: DeviceContext) -> np.ndarray | None:
        if self.plan.federate == "full":
            return model_params.full_vector(ctx.model)
        return model_params.adapter_vector(ctx.model)
