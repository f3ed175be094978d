"""A technique with nothing to do on a device (a test fixture, issue 55): its server rule scales every phase's
target prototypes by `server_only_scale` and counts the phases it scaled (its state, checkpointed). It declares
`device_free`, so it is installed on the server alone and devices without it still join."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from protofl import technique
from protofl.technique import ServerRule, flag, number

log = logging.getLogger("server_only")


@dataclass
class Scaled:
    scaled_phases: int = 0


class Technique(technique.Technique):
    name = "server_only"
    order = 90
    device_free = True
    options = {"server_only": flag("server_only"), "server_only_scale": number("server_only_scale", 1.0, True)}

    def server_rule(self, model: Any) -> ServerRule:
        return ScaleRule(model)


class ScaleRule(ServerRule):
    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self.state = Scaled()

    def adjust_targets(self, table: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        scale = float(self.model.cfg.server_only_scale)
        self.state.scaled_phases += 1
        log.warning("server_only scaled %d targets by %g (phase %d)", len(table), scale, self.state.scaled_phases)
        return {c: (v * scale).astype(v.dtype) for c, v in table.items()}
