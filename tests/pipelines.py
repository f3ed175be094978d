"""Stage sets that tests spell out instead of borrowing a preset's default (which follows the benchmark).

ADAPTER_PIPELINE is the combined pipeline's mean-prototype variant: APUD sparse adapters and CPS-compressed,
scaled prototypes in one upload, every upload kind a round can carry. Tests of adapters, of ERPA's two
phases (add erpa=True with a partial public set) and of durability use it with `--preset protofl`.
"""

from __future__ import annotations

import json
from typing import Any

ADAPTER_PIPELINE: dict[str, Any] = dict(
    federate="adapter",
    prototypes="mean",
    consensus=False,
    erpa=False,
    apud=True,
    cps=True,
    scaling=True,
    mu="auto",
    refine=False,
)


def as_cli_sets(switches: dict[str, Any]) -> list[str]:
    """`--set key=value` arguments for the CLI (values as JSON, strings bare)."""
    out: list[str] = []
    for key, value in switches.items():
        out += ["--set", f"{key}={value if isinstance(value, str) else json.dumps(value)}"]
    return out
