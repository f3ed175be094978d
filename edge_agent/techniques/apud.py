"""APUD's device half (RefProtoFL Alg. 1): the adapter travels as its K coordinates that moved most.

K comes from the config's ratio or byte budget; an upload budget (a device profile's link) may lower it
further (edge_agent/core/uploads.py searches K on the real encoded size). The math and the server half are
protofl/algorithms/apud.py.
"""

from __future__ import annotations

import numpy as np

from edge_agent.techniques import DeviceRule, Sparsifier
from protofl.algorithms import apud
from protofl.sparse import SparseVector


class ApudDevice(DeviceRule):
    name = "apud"

    def sparsifier(self, theta: np.ndarray) -> Sparsifier | None:
        if self.plan.federate != "adapter":
            return None
        k = apud.client_budget(theta.shape[0], self.cfg.apud_ratio, self.cfg.apud_budget_bytes)
        return Sparsifier(k=k, select=_select_topk)


def _select_topk(theta: np.ndarray, theta_global: np.ndarray | None, k: int) -> SparseVector:
    """Alg. 1's top-K against the global adapter the round opened with.

    An adapter round always has one (the agent trains a round only once it holds the round's adapter); a
    ValueError, like select_topk's own for mismatched shapes, fails the round rather than sending garbage."""
    if theta_global is None:
        raise ValueError("APUD: no global adapter to measure the local update against")
    return apud.select_topk(theta, theta_global, k)
