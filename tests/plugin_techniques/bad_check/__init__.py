"""A third-party technique whose `check` raises on every config (a test fixture): written for checks that ran on
every federation, it must not break those that leave it off."""

from __future__ import annotations

from typing import Any

from protofl import technique
from protofl.technique import flag


class Technique(technique.Technique):
    name = "bad_check"
    options = {"bad_check": flag("bad_check")}

    def check(self, cfg: Any) -> None:
        raise RuntimeError("bad_check is broken")
