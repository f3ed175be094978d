"""Numbers for people: one byte formatter for every log line, table and report caption."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """`512 B`, `1.5 KB`, `2.0 MB`, `3.1 GB` (binary units: 1 KB = 1024 B); GB is the largest unit."""
    for unit in ("B", "KB", "MB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def human_duration(seconds: float) -> str:
    """`42.0 s`, `14 min 30 s`, `2 h 05 min` (simulated time in progress lines and reports)."""
    s = float(seconds)
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60):02d} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"
