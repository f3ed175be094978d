"""Parameter federation as a device rule: which of the model's parameters a federation shares (the plan's `federate`).

On the server, sharing parameters is a technique (FedAvg folds the vector the plan names). On a device the same
choice decides four things, and each way of sharing is one small rule here that says them: the layout the config
announces and the decoder limits it implies, which parameters a loss term that pulls towards the shared ones reads
(its reference is those parameters as the round starts), the vector a parameter upload carries, and the round whose
global parameters a device's training is based on (an upload's `base_round`, and whether the device holds the
round's parameters at all). The agent asks the rule of its federation and names none, so a partial-layer, FedBN or
low-rank adapter federation is one more rule (`register`), not an edit of the agent.

    none     nothing shared: each device's model is its own (the prototype presets)
    adapter  the federated adapter theta_a = (A_f, H) (edge_agent/training/params.py), from the round message's
    `adapter`
    full     every parameter and floating-point buffer of the model (FedAvg), from the round message's `params`
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from edge_agent.training import params as model_params
from protofl.adapter import layout_size
from protofl.errors import ConfigError
from protofl.plan import RoundPlan
from protofl.wire import Config, Limits

__all__ = ["Adapter", "FullModel", "ParamFederation", "param_federation", "register"]


class ParamFederation:
    """One way of sharing parameters, as a device sees it. The default shares nothing: the whole private model is
    the device's own, its training is based on the round it trains, and a pull towards the shared parameters pulls
    every parameter towards the round's start."""

    name = "none"
    # Whether a device scores the official test set in simulation: its model's accuracy there says something only
    # where the model is its own (where the whole model is shared, the aggregate's is scored by the simulator).
    scores_test_set = True

    def shared_parameters(self, model: nn.Module) -> list[torch.Tensor]:
        """The parameters a technique's pull towards the shared ones reads (edge_agent/techniques), in the order of
        the shared vector (the whole private model's where nothing is shared)."""
        return list(model.parameters())

    def vector(self, model: nn.Module) -> np.ndarray | None:
        """What a parameter upload carries (None: nothing shared)."""
        return None

    def own_global(self, model: nn.Module) -> np.ndarray | None:
        """The vector a device that holds no global one yet takes as its round's (sizing uploads without a server);
        None where training needs none."""
        return None

    def layout_problem(self, model: nn.Module, msg: Config) -> str | None:
        """Why the config's announced layout does not fit `model` (None: it fits, or none is announced)."""
        return None

    def limits(self, plan: RoundPlan, model: nn.Module) -> Limits:
        """This federation's decoder limits: its largest messages carry what is shared (RoundPlan.limits)."""
        return plan.limits(None, layout_size(model_params.adapter_layout(model)))

    def base_round(self, held: int, round_: int) -> int:
        """The round whose global parameters round `round_`'s training starts from, where the device holds those
        of round `held` (-1: none yet); -1 where it holds nothing to train from. A round based on another round
        than its own is stale (its upload would be dropped)."""
        return round_


class Adapter(ParamFederation):
    """The federated adapter and head: a device trains only from a global adapter it holds, and its upload is based
    on the round that adapter came with."""

    name = "adapter"

    def shared_parameters(self, model: nn.Module) -> list[torch.Tensor]:
        return [p for _, module in model_params.adapter_modules(model) for p in module.parameters()]

    def vector(self, model: nn.Module) -> np.ndarray:
        return model_params.adapter_vector(model)

    def own_global(self, model: nn.Module) -> np.ndarray:
        return model_params.adapter_vector(model)

    def layout_problem(self, model: nn.Module, msg: Config) -> str | None:
        mine = [(n, tuple(s)) for n, s in model_params.adapter_layout(model)]
        theirs = [(n, tuple(s)) for n, s in msg.adapter_layout]
        return None if mine == theirs else f"adapter layout mismatch: server {theirs[:2]}..., device {mine[:2]}..."

    def base_round(self, held: int, round_: int) -> int:
        return held


class FullModel(ParamFederation):
    """The whole model: every round message carries it, so a device always trains from the round's."""

    name = "full"
    scores_test_set = False

    def vector(self, model: nn.Module) -> np.ndarray:
        return model_params.full_vector(model)

    def limits(self, plan: RoundPlan, model: nn.Module) -> Limits:
        return plan.limits(
            layout_size(model_params.full_layout(model)), layout_size(model_params.adapter_layout(model))
        )


_RULES: dict[str, ParamFederation] = {rule.name: rule for rule in (ParamFederation(), Adapter(), FullModel())}


def register(rule: ParamFederation) -> None:
    """Add a way of sharing parameters under `rule.name` (a plug-in's; the server must know the name too)."""
    _RULES[rule.name] = rule


def param_federation(federate: str) -> ParamFederation:
    """The rule of `federate` (ConfigError naming the known ones otherwise)."""
    try:
        return _RULES[federate]
    except KeyError:
        raise ConfigError(
            f"federate={federate!r}: not a known way of federating parameters; known: {', '.join(sorted(_RULES))}"
        ) from None
