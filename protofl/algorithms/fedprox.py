"""FedProx (Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020): a proximal term in the
clients' local objective.

Each client k minimises, in round t, its local loss plus the proximal term of the paper's eq. (2),

    h_k(w; w^t) = F_k(w) + (mu / 2) * ||w - w^t||^2,

where w^t is the model the round started from: a local solution may not drift far from it, which bounds
the damage of heterogeneous data and of uneven amounts of local work. Here w is what the federation shares
(the whole model with federate="full", the federated adapter with "adapter") and w^t those parameters as the
round message delivered them (docs/algorithms.md, "FedProx"); the device half, the term and its gradient
mu * (w - w^t), is edge_agent/techniques/fedprox.py.

With nothing shared (federate="none": the prototype presets), every device's round starts from its own
private model, so w^t is that: the term pulls every parameter of the private model towards its values at the
round's start (the paper's proximal term with the device's own starting point, as its Algorithm 2 has it for
any local solver's start): a bound on how far one round of local training moves the private backbone, which
the prototype targets then steer. It is a regulariser of the private models, not a pull towards a global one;
docs/algorithms.md says so beside the shared case.

The server needs nothing new: FedProx aggregates as FedAvg does (the paper's Algorithm 2 averages the local
solutions), so the parameter vectors go through the existing mean (protofl/algorithms/fedavg.py, or the
replacement another technique offers for sparse uploads). The technique is the option `prox_mu` (mu, a finite
number >= 0, default 0: off), its combination rule, and nothing else.
"""

from __future__ import annotations

from typing import Any

from protofl.technique import Option, Technique, is_number

__all__ = ["FedProx"]


def _check_mu(value: Any) -> str | None:
    if not is_number(value):
        return f"config 'prox_mu' must be a finite number, got {value!r}"
    return None if value >= 0 else f"prox_mu must be >= 0 (0: FedProx off), got {value}"


class FedProx(Technique):
    """The proximal term mu/2 ||w - w^t||^2 on the shared parameters; active when prox_mu > 0."""

    name = "fedprox"
    order = 90  # nothing to shape in the plan; its device term is added after the other rules' terms
    options = {"prox_mu": Option(0.0, _check_mu)}

    def active(self, cfg: Any) -> bool:
        return bool(cfg.prox_mu > 0)
