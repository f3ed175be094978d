"""The device's one reading of a federation's `config` message: this federation as this device sees it, or why not.

Every config a device sees goes through `read_config`, once: the runner reads the first one with it (it needs
the federation's config to load its data), and hands what it read to the agent, which reads every later one
itself. In order: the options (`FederationConfig.from_dict`), what this device can afford
(edge_agent/core/guard.py), the round plan, and the device rules of the plan's techniques (a technique installed on
the server but not here is refused with what to install), the way it shares parameters
(edge_agent/training/param_federation.py), its DP mechanism and the sealing stages its uploads pass
(edge_agent/core/sealing.py).
Anything refused is one `ConfigError` with the reason; nothing here changes the device's state. The agent holds what
was read as one object, replaced whole when a new config arrives.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from edge_agent.core import guard
from edge_agent.core.sealing import PrivacyNoise, Stage
from edge_agent.core.secagg_device import Masking
from edge_agent.techniques import DeviceRule, rules_for
from edge_agent.training.param_federation import ParamFederation, param_federation
from protofl import privacy
from protofl.config import FederationConfig
from protofl.errors import ConfigError
from protofl.plan import RoundPlan
from protofl.wire import Config

__all__ = ["DeviceConfig", "read_config"]


@dataclass(frozen=True)
class DeviceConfig:
    """A config message this device can adopt: its options, plan, the active techniques' device rules, how it
    shares parameters, its DP mechanism and the sealing stages of its uploads (the rules and stages keep what they
    need between rounds: they belong to this federation, and go with it)."""

    message: Config
    cfg: FederationConfig
    plan: RoundPlan
    rules: tuple[DeviceRule, ...]
    sample_shape: tuple[int, ...] | None = None  # the data shape it was checked against (None: not yet)
    sharing: ParamFederation = dataclasses.field(default_factory=ParamFederation)
    dp: privacy.DpSettings | None = None
    stages: tuple[Stage, ...] = ()

    @property
    def masks(self) -> np.ndarray | None:
        """The config's support masks, where the plan's prototypes use them."""
        return self.message.class_masks if self.plan.masked else None

    def samples_sent(self, n: int) -> int:
        """The sample count an upload carries for `n` samples: 1 under DP (the count stays on the device)."""
        return 1 if self.dp is not None else n

    def for_data(self, sample_shape: tuple[int, ...]) -> DeviceConfig:
        """The same config, checked against this device's data too (ConfigError if its shape is not the data's)."""
        if self.sample_shape == tuple(sample_shape):
            return self
        problem = guard.shape_problem(self.cfg, tuple(sample_shape))  # the rest was checked when it was read
        if problem is not None:
            raise ConfigError(problem)
        return dataclasses.replace(self, sample_shape=tuple(sample_shape))


def read_config(msg: Config, sample_shape: tuple[int, ...] | None = None) -> DeviceConfig:
    """What `msg` asks of this device, checked (against its data's `sample_shape` where known); ConfigError
    with the reason otherwise."""
    try:
        cfg = FederationConfig.from_dict(dict(msg.params))
    except TypeError as exc:
        raise ConfigError(str(exc)) from None
    problem = guard.config_problem(cfg, None if sample_shape is None else tuple(sample_shape))
    if problem is not None:
        raise ConfigError(problem)
    plan = RoundPlan.from_config(cfg)
    rules = tuple(rules_for(cfg, plan, msg))
    dp = privacy.resolve(cfg, plan)
    shape = None if sample_shape is None else tuple(sample_shape)
    return DeviceConfig(
        msg, cfg, plan, rules, shape, param_federation(plan.federate), dp, sealing_stages(cfg, plan, dp)
    )


def sealing_stages(cfg: FederationConfig, plan: RoundPlan, dp: privacy.DpSettings | None) -> tuple[Stage, ...]:
    """The stages a federation's uploads pass on their way to the wire, in order: privacy noise, then masking."""
    stages: list[Stage] = []
    if dp is not None:
        stages.append(PrivacyNoise(dp, cfg.min_clients))
    if cfg.secagg:
        share = dp.device_std(cfg.min_clients) if dp is not None and dp.mode == "distributed" else None
        stages.append(Masking(plan, share))  # (distributed DP: a noise share for the classes it lacks, too)
    return tuple(stages)
