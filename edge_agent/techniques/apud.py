"""APUD's device half (RefProtoFL Alg. 1): the adapter travels as its K coordinates that moved most.

K comes from the config's ratio or byte budget; an upload budget (a device profile's link) may lower it
further (edge_agent/uploads.py searches K on the real encoded size). The math and the server half are
protofl/algorithms/apud.py.
"""

from __future__ import annotations

import numpy as np

from edge_agent.techniques import DeviceRule, Sparsifier
from protofl.algorithms import apud


class ApudDevice(DeviceRule):
    name = "apud"

    def sparsifier(self, theta: np.ndarray) -> Sparsifier | None:
        if self.plan.federate != "adapter":
            return None
        k = apud.client_budget(theta.shape[0], self.cfg.apud_ratio, self.cfg.apud_budget_bytes)
        return Sparsifier(k=k, select=apud.select_topk)
