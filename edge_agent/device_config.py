"""The device's one reading of a federation's `config` message: what it may adopt, or why not.

Every config a device sees goes through `read_config`, once: the runner reads the first one with it (it needs
the federation's config to load its data), and hands what it read to the agent, which reads every later one
itself. In order: the options (`FederationConfig.from_dict`), what this device can afford
(edge_agent/guard.py), the round plan, and the device rules of the plan's techniques (a technique installed on
the server but not here is refused with what to install). Anything refused is one `ConfigError` with the
reason; nothing here changes the device's state.
"""

from __future__ import annotations

from dataclasses import dataclass

from edge_agent import guard
from edge_agent.techniques import DeviceRule, rules_for
from protofl.config import FederationConfig
from protofl.errors import ConfigError
from protofl.plan import RoundPlan
from protofl.wire import Config

__all__ = ["DeviceConfig", "read_config"]


@dataclass(frozen=True)
class DeviceConfig:
    """A config message this device can adopt: its options, plan and the active techniques' device rules."""

    message: Config
    cfg: FederationConfig
    plan: RoundPlan
    rules: tuple[DeviceRule, ...]
    sample_shape: tuple[int, ...] | None = None  # the data shape it was checked against (None: not yet)

    def for_data(self, sample_shape: tuple[int, ...]) -> DeviceConfig:
        """The same config, checked against this device's data too (ConfigError if its shape is not the data's)."""
        if self.sample_shape == tuple(sample_shape):
            return self
        problem = guard.shape_problem(self.cfg, tuple(sample_shape))  # the rest was checked when it was read
        if problem is not None:
            raise ConfigError(problem)
        return DeviceConfig(self.message, self.cfg, self.plan, self.rules, tuple(sample_shape))


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
    return DeviceConfig(msg, cfg, plan, rules, None if sample_shape is None else tuple(sample_shape))
