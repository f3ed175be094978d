"""The measured peak memory of a `join` per architecture and preset: `footprint.json` beside this module, written by
`bench/bench_footprint.py --package-data` with the machine and date it was measured on. Read by `protofl-edge
models` (edge_agent/ops/model_sizes.py) and `protofl-edge doctor` (a run's model against free memory); light: no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protofl.errors import ConfigError

FOOTPRINT = Path(__file__).with_name("footprint.json")


@dataclass(frozen=True)
class Footprint:
    """The measured peaks (MB) of `footprint.json`, with where and how they were measured."""

    peak_mb: dict[str, dict[str, float]]
    machine: str
    date: str
    command: str
    threads: int

    def peak(self, arch: str, preset: str) -> float | None:
        return self.peak_mb.get(arch, {}).get(preset)


def load_footprint(path: Path = FOOTPRINT) -> Footprint | None:
    """The shipped measurements, or None where the file is absent (a checkout whose benchmark never ran)."""
    if not path.is_file():
        return None
    try:
        raw: dict[str, Any] = json.loads(path.read_text())
        return Footprint(
            {a: {p: float(v) for p, v in row.items()} for a, row in raw["peak_mb"].items()},
            str(raw["machine"]),
            str(raw["date"]),
            str(raw["command"]),
            int(raw["threads"]),
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        what = "bench/bench_footprint.py"
        raise ConfigError(f"{path} is not a footprint file of {what} ({exc}): regenerate it") from None


def peak_mb(arch: str, preset: str | None = None, path: Path = FOOTPRINT) -> float | None:
    """`arch`'s measured peak under `preset`, or its highest over the presets measured (None: not measured)."""
    found = load_footprint(path)
    row = found.peak_mb.get(arch, {}) if found is not None else {}
    if preset is not None and preset in row:
        return row[preset]
    return max(row.values()) if row else None
