"""Stage sets that tests spell out instead of borrowing a preset's default (which follows the benchmark).

ADAPTER_PIPELINE is the combined pipeline's mean-prototype variant: APUD sparse adapters and CPS-compressed,
scaled prototypes in one upload, every upload kind a round can carry. Tests of adapters, of ERPA's two
phases (add erpa=True with a partial public set) and of durability use it with `--preset protofl`.
"""

from __future__ import annotations

import json
from typing import Any

# The step floor off (`min_local_steps` 0: a round trains its `local_epochs` alone), for tests whose point is not how
# much a device trains (transport parity, bytes on the wire, faults, the fleet's operations, the doc pages' sizes): on
# their small synthetic sets the default floor of 20 SGD steps a round is up to 9x the training
# (tests/broker_server/test_mqtt_parity.py: 36 s of CPU for a 3-round protofl run against 4 s). The default itself runs
# in the golden reports, test_step_floor.py, the crash tests, the default preset's deploy and lite tests and the field
# trial.
NO_FLOOR: dict[str, Any] = {"min_local_steps": 0}

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
