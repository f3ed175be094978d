"""A technique with nothing to do on a device (a test fixture, issue 55): its server rule counts the phases it saw
open (its state, checkpointed) and logs each with its `server_only_tag`. It declares `device_free`, so it is
installed on the server alone and devices without it still join."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from protofl import technique
from protofl.technique import Fold, Option, Phase, ServerRule, flag

log = logging.getLogger("server_only")


def _tag(value: Any) -> str | None:
    return None if isinstance(value, str) else f"config 'server_only_tag' must be a string, got {value!r}"


@dataclass
class Seen:
    phases: int = 0


class Technique(technique.Technique):
    name = "server_only"
    order = 90
    device_free = True
    options = {"server_only": flag("server_only"), "server_only_tag": Option("", _tag)}

    def server_rule(self, model: Any) -> ServerRule:
        return SeenRule(model)


class SeenRule(ServerRule):
    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self.state = Seen()

    def folds(self, phase: Phase) -> list[Fold]:
        self.state.phases += 1
        log.warning(
            "server_only[%s] saw phase %s open (%d so far)",
            self.model.cfg.server_only_tag,
            phase.value,
            self.state.phases,
        )
        return []
