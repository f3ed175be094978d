"""What both `protofl-server` commands parse the same way (`simulate` and `start`)."""

from __future__ import annotations

import json
from typing import Any

from protofl.errors import ConfigError


def parse_sets(items: list[str]) -> dict[str, Any]:
    """`--set key=value` overrides: the value as JSON (numbers, true, lists), else as a bare string."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got '{item}'")
        key, raw = item.split("=", 1)
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw  # a bare string such as mu=auto
    return out
