"""Human-readable sizes for logs and tables."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """1023 -> '1023 B', 1536 -> '1.5 KB', up to GB."""
    for unit in ("B", "KB", "MB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"
