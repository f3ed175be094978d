"""Numbers for people: one byte formatter for every log line, table and report caption, and the names that say
what each accuracy measures."""

from __future__ import annotations

from collections.abc import Iterable


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


# What each accuracy is, in the words people read (tables, log lines, the live page, /metrics' help, reports).
# The machine-readable names stay as they are (JSON keys, rounds.jsonl fields, Prometheus label values: renaming
# them breaks whoever reads them). "local" is each device's model on a held-out part of its own data, so on the
# classes that device holds only; read as the federation's accuracy it misleads (issue 41), so it says so.
OWN_CLASSES = "own classes"
_LEGEND = {
    "local": f"local ({OWN_CLASSES}) = each device's model on a held-out part of its own data, so on the classes "
    "it holds only: not the federation's accuracy on every class",
    "global": "global = each device's model on the test set of every class, averaged (FedAvg: the global model)",
    "proto": "proto = by the nearest global prototype instead of the head",
    "ensemble": "ensemble = the devices' averaged class probabilities on the test set",
    "predictor": "predictor = the global predictor, one model a new device could be given, on the test set (start: "
    "on the server's --validation data)",
}


def accuracy_label(key: str, noun: str = "") -> str:
    """How a table or a line names the accuracy `key`: `local_acc` -> "local (own classes)" (with `noun` "acc":
    "local acc (own classes)"), `global_acc` -> "global", `global_proto_acc` -> "global proto"."""
    name = " ".join(filter(None, (key.removesuffix("_acc").replace("_", " "), noun)))
    return f"{name} ({OWN_CLASSES})" if key.startswith("local") else name


def accuracy_legend(keys: Iterable[str]) -> str:
    """One line saying what the accuracies `keys` (JSON keys, e.g. `local_acc`) measure, in a fixed order
    (local, global, proto, ensemble, predictor)."""
    words = {w for key in keys for w in key.removesuffix("_acc").split("_")}
    return "; ".join(text for name, text in _LEGEND.items() if name in words)
