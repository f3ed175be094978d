"""A third-party technique whose option `mu` clashes with CPS's (a test fixture): it must not break any federation."""

from __future__ import annotations

from protofl import technique
from protofl.technique import flag, number


class Technique(technique.Technique):
    name = "clash_mu"
    options = {"clash_mu": flag("clash_mu"), "mu": number("mu", 0.5)}
