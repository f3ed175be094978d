"""Record the golden reports: `python tests/golden/record.py tests/golden [CASE ...]` (see README.md).

Importing this module only defines the cases; torch and the simulator are imported when recording.
"""

from __future__ import annotations

import json
import sys
from typing import Any

FED: dict[str, Any] = dict(dataset="synthetic:n=1200,n_test=300", clients=4, alpha=0.5, rounds=2, seed=3)
CASES: dict[str, dict[str, Any]] = {
    "fedavg": {},
    "fedproto": {},
    "refprotofl": {},
    "tinyproto": {},
    "fedpagr": {},
    "protofl": {},
    # the default preset (spherical CPS) with ERPA's public-set anchors on half the classes: candidate (d)
    "protofl-erpa": {"preset": "protofl", "overrides": {"erpa": True, "public_classes": (0, 1, 2, 3, 4)}},
}


def main(out: str, only: list[str] | None = None) -> None:
    import torch

    from broker_server.simulation import SimulationSpec, run_simulation

    torch.set_num_threads(1)
    for name, extra in CASES.items():
        if only and name not in only:
            continue
        report = run_simulation(SimulationSpec(**{"preset": name, **FED, **extra}))
        report["totals"].pop("wall_s")
        report.pop("machine")  # where it ran (CPU model, thread counts): not behaviour
        with open(f"{out}/{name}.json", "w") as fh:
            json.dump(report, fh, indent=1, sort_keys=True)
        print(name, report["totals"], flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or None)  # optional case names: record only those
