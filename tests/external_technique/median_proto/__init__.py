"""A technique from outside protofl-edge: FedProto with a coordinate-wise median of prototypes.

It is what a third-party package looks like: a server half (a `Technique`, numpy) and a device half (a
`DeviceRule`, torch) registered under one name through the entry-point groups `protofl.techniques` and
`protofl.device_rules` (median_proto-0.1.dist-info/entry_points.txt; a real package declares them in its
pyproject.toml). Nothing of protofl-edge changes for it.

- server: the global prototype of a class is the coordinate-wise median of the clients' prototypes (it
  replaces FedProto's n-weighted mean through the `mean_aggregator` hook);
- device: prototypes travel without their counts (a median needs none, so the label histogram stays home).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from protofl.technique import ServerRule, Technique, flag

NAME = "median_proto"


class MedianAggregator:
    """Per class, every client's row; the result is their coordinate-wise median."""

    def __init__(self, num_classes: int, width: int) -> None:
        self.num_classes, self.width = num_classes, width
        self.rows: dict[int, list[np.ndarray]] = {}
        self.senders = 0

    def check(self, table: dict[int, np.ndarray]) -> None:
        for c, v in table.items():
            if not 0 <= c < self.num_classes or np.shape(v) != (self.width,) or not np.isfinite(v).all():
                raise ValueError(f"median: bad prototype for class {c}")

    def add(self, table: dict[int, np.ndarray]) -> None:
        self.check(table)
        for c, v in table.items():
            self.rows.setdefault(int(c), []).append(np.asarray(v, np.float64))
        self.senders += 1

    def result(self) -> dict[int, np.ndarray]:
        return {c: np.median(np.stack(rows), axis=0).astype(np.float32) for c, rows in sorted(self.rows.items())}


class MedianProto(Technique):
    name = NAME
    order = 60
    options = {"median_prototypes": flag("median_prototypes")}
    presets = {"fedproto-median": dict(federate="none", prototypes="mean", median_prototypes=True)}

    def active(self, cfg: Any) -> bool:
        return bool(cfg.median_prototypes)

    def check(self, cfg: Any) -> None:
        from protofl.errors import ConfigError

        if cfg.median_prototypes and cfg.prototypes != "mean":
            raise ConfigError("median_prototypes takes the median of mean prototypes: set prototypes='mean'")

    def server_rule(self, model: Any) -> ServerRule:
        return MedianRule(model)


class MedianRule(ServerRule):
    def mean_aggregator(self, width: int) -> Any | None:
        return MedianAggregator(self.model.plan.num_classes, width)
