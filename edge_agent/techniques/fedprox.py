"""FedProx's device half (Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020, eq. 2):
the proximal term added to the round's objective,

    (mu / 2) * ||w - w^t||^2,        gradient  mu * (w - w^t),

over exactly what the federation shares: every parameter of the model with federate="full", the federated
adapter (A_f and the head, edge_agent/training/params.py) with "adapter"; with nothing shared ("none", the prototype
presets) every parameter of the private model, w^t being the device's own model at the round's start
(protofl/algorithms/fedprox.py says why). w^t is those parameters as the round's
local training starts from them: the global vector the round message delivered, loaded into the model
(after any rule set the model up for the round, e.g. an anchored head), copied and detached when the
objective is built. Buffers (BatchNorm statistics) travel with the full model but have no gradient: the term
is over parameters, as the paper's reference code has it; a parameter that does not train this round (a
frozen backbone, a fixed head) stays at w^t and adds nothing, so the sum skips it.

The term is added after the other rules' terms (the classifier's loss, alignment, entropy). The server half
(the option prox_mu and its combination rule; the aggregation is the existing mean) is
protofl/algorithms/fedprox.py; docs/algorithms.md, "FedProx", has a hand-computed example.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from edge_agent.techniques import Batch, DeviceContext, DeviceRule, LossTerm
from edge_agent.training.param_federation import param_federation

__all__ = ["FedProxDevice", "ProximalTerm", "proximal_term", "shared_parameters"]


def proximal_term(params: Sequence[torch.Tensor], reference: Sequence[torch.Tensor], mu: float) -> torch.Tensor:
    """(mu / 2) * sum_i ||w_i - w^t_i||^2 over paired tensors; 0 (a tensor) for none."""
    total: torch.Tensor | None = None
    for w, ref in zip(params, reference, strict=True):
        sq = (w - ref).pow(2).sum()
        total = sq if total is None else total + sq
    return (mu / 2) * (total if total is not None else torch.zeros(()))


def shared_parameters(model: nn.Module, federate: str) -> list[torch.Tensor]:
    """The parameters the term pulls: those the federation shares, the whole model's ("full") or the adapter's and
    head's ("adapter"), in the order the vector of edge_agent/training/params.py has them; with nothing shared ("none")
    the whole private model's. The way of sharing says which (edge_agent/training/param_federation.py)."""
    return param_federation(federate).shared_parameters(model)


class ProximalTerm(LossTerm):
    """(mu / 2) * ||w - w^t||^2 on the live parameters `params`, w^t their values when the term was built."""

    def __init__(self, params: Sequence[torch.Tensor], mu: float) -> None:
        self.params = list(params)
        self.reference = [p.detach().clone() for p in self.params]
        self.mu = mu

    def loss(self, batch: Batch) -> torch.Tensor:
        pairs = [(w, ref) for w, ref in zip(self.params, self.reference, strict=True) if w.requires_grad]
        return proximal_term([w for w, _ in pairs], [ref for _, ref in pairs], self.mu)

    def __deepcopy__(self, memo: dict[int, Any]) -> ProximalTerm:
        # The term refers to the live model's parameters and keeps a reference nothing changes: a copy (the agent
        # snapshots its round state) must not detach it from the model (restoring the model copies into the same
        # tensors), nor copy the model.
        return self


class FedProxDevice(DeviceRule):
    name = "fedprox"

    def loss_terms(self, ctx: DeviceContext, table: dict[int, np.ndarray], fresh: bool) -> Sequence[LossTerm]:
        if not fresh:
            # An objective rebuilt from a checkpoint serves the metrics and artifacts; a round is always trained
            # on one built from its round message, whose w^t is what that message delivered.
            return ()
        return (ProximalTerm(shared_parameters(ctx.model, self.plan.federate), float(self.cfg.prox_mu)),)
