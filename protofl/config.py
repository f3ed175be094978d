"""Federation configuration: one frozen dataclass, validated on construction.

A preset (see `protofl.presets`) is just a set of overrides of these fields; the aggregator and the
agent read the stage switches (`erpa`, `apud`, `cps`, `scaling`, `refine`, ...) and compose the
stages they name. The config travels to devices inside the retained `config` message, so every field
is a plain msgpack value.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protofl.errors import ConfigError

FEDERATE_CHOICES = ("full", "adapter", "none")
PROTOTYPE_CHOICES = ("none", "mean", "unit")
DTYPE_CHOICES = ("f4", "f2", "q8")


@dataclass(frozen=True)
class FederationConfig:
    preset: str = "protofl"
    seed: int = 0
    rounds: int = 10
    # The client model: backbone(s) round-robin over clients, prototype space z in R^m.
    archs: tuple[str, ...] = ("cnn",)
    num_classes: int = 10
    in_shape: tuple[int, int, int] = (1, 28, 28)
    proto_dim: int = 512
    adapter_rank: int = 32
    # Local training (RefProtoFL Sec. 5.1 defaults).
    local_epochs: int = 1
    batch_size: int = 64
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 1e-4
    backbone: str = "train"  # "train" | "frozen" (RefProtoFL contradicts itself; both supported)
    # What crosses the network.
    federate: str = "adapter"  # "full" (FedAvg), "adapter" (theta_a via APUD or dense), "none"
    prototypes: str = "mean"  # "none", "mean" (FedProto-style), "unit" (FedPAGR, on the sphere)
    aggregation: str = "weighted"  # FedProto global prototype: "weighted" (paper) or "mean" (PFLlib)
    proto_lambda: float = 1.0
    # RefProtoFL stages.
    erpa: bool = False
    public_per_class: int = 20
    public_classes: tuple[int, ...] | None = None  # None = every class
    apud: bool = False
    apud_ratio: float = 0.1
    apud_budget_bytes: int | None = None  # a device profile may set a byte budget instead of a ratio
    # TinyProto stages.
    cps: bool = False
    cps_s: int | None = None  # None = m // 10
    scaling: bool = False
    mu: float | str = 1.5e-4  # a float, or "auto" (rescale G_c to the client's own prototype norm)
    # FedPAGR stages.
    consensus: bool = False  # consensus projection g_k, unit prototypes, head anchoring, composite loss
    refine: bool = False
    refine_steps: int = 5
    refine_lr: float = 0.01
    refine_momentum: float = 0.9
    lambda_s: float = 0.5
    margin: float = 0.3
    beta: float = 0.1
    lambda_e: float = 0.1
    # FedPAGR Alg. 1 trains only f_k and g_k: the anchored head stays fixed during the round. True is the
    # variant that also trains it (a benchmark row).
    pagr_train_head: bool = False
    # Wire.
    proto_dtype: str = "f4"
    adapter_dtype: str = "f4"
    # Rounds and faults.
    min_clients: int = 1
    round_timeout: float = 600.0

    def __post_init__(self) -> None:
        self._validate()

    # -- derived values -------------------------------------------------------------------------
    @property
    def s(self) -> int:
        """CPS support size per class (TinyProto's s; default m/10)."""
        return self.cps_s if self.cps_s is not None else max(1, self.proto_dim // 10)

    @property
    def public_class_list(self) -> tuple[int, ...]:
        if not self.erpa or self.public_per_class == 0:
            return ()
        if self.public_classes is None:
            return tuple(range(self.num_classes))
        return tuple(sorted(set(self.public_classes)))

    def arch_for(self, client_index: int) -> str:
        return self.archs[client_index % len(self.archs)]

    # -- (de)serialisation ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["archs"] = list(self.archs)
        out["in_shape"] = list(self.in_shape)
        if self.public_classes is not None:
            out["public_classes"] = list(self.public_classes)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "FederationConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config key(s) {unknown}; known keys: {sorted(known)}")
        kwargs = dict(data)
        for key in ("archs", "in_shape", "public_classes"):
            if isinstance(kwargs.get(key), list):
                kwargs[key] = tuple(kwargs[key])
        if isinstance(kwargs.get("archs"), str):
            kwargs["archs"] = tuple(a for a in kwargs["archs"].split(",") if a)
        return cls(**kwargs)

    def replace(self, **changes: Any) -> "FederationConfig":
        return dataclasses.replace(self, **changes)

    # -- validation -----------------------------------------------------------------------------
    def _validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        types = {f.name: f.type for f in dataclasses.fields(self)}
        for name in ("seed", "rounds", "num_classes", "proto_dim", "adapter_rank", "local_epochs",
                     "batch_size", "public_per_class", "min_clients", "refine_steps"):
            value = getattr(self, name)
            need(isinstance(value, int) and not isinstance(value, bool),
                 f"config '{name}' must be an integer, got {value!r}")
        for name in ("lr", "momentum", "weight_decay", "proto_lambda", "apud_ratio", "round_timeout",
                     "refine_lr", "refine_momentum", "lambda_s", "margin", "beta", "lambda_e"):
            value = getattr(self, name)
            need(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
                 f"config '{name}' must be a finite number, got {value!r}")
        del types
        for name in ("erpa", "apud", "cps", "scaling", "consensus", "refine", "pagr_train_head"):
            need(isinstance(getattr(self, name), bool), f"config '{name}' must be true or false, got {getattr(self, name)!r}")
        need(self.rounds >= 1, f"rounds must be >= 1, got {self.rounds}")
        need(2 <= self.num_classes <= 65535, f"num_classes must be in [2, 65535], got {self.num_classes}")
        need(1 <= self.proto_dim <= 65536, f"proto_dim must be in [1, 65536], got {self.proto_dim}")
        need(1 <= self.adapter_rank <= self.proto_dim,
             f"adapter_rank must be in [1, proto_dim={self.proto_dim}], got {self.adapter_rank}")
        need(self.local_epochs >= 1 and self.batch_size >= 1, "local_epochs and batch_size must be >= 1")
        need(self.lr > 0, f"lr must be > 0, got {self.lr}")
        need(len(self.archs) >= 1 and all(isinstance(a, str) and a for a in self.archs),
             f"archs must be a non-empty list of architecture names, got {self.archs!r}")
        need(len(self.in_shape) == 3 and all(isinstance(v, int) and v > 0 for v in self.in_shape),
             f"in_shape must be (channels, height, width), got {self.in_shape!r}")
        need(self.backbone in ("train", "frozen"), f"backbone must be 'train' or 'frozen', got {self.backbone!r}")
        need(self.federate in FEDERATE_CHOICES, f"federate must be one of {FEDERATE_CHOICES}, got {self.federate!r}")
        need(self.prototypes in PROTOTYPE_CHOICES,
             f"prototypes must be one of {PROTOTYPE_CHOICES}, got {self.prototypes!r}")
        need(self.aggregation in ("weighted", "mean"), "aggregation must be 'weighted' or 'mean'")
        need(0 < self.apud_ratio <= 1, f"apud_ratio must be in (0, 1], got {self.apud_ratio}")
        need(self.apud_budget_bytes is None or self.apud_budget_bytes > 0, "apud_budget_bytes must be > 0")
        need(1 <= self.s <= self.proto_dim, f"cps_s must be in [1, proto_dim], got {self.s}")
        need(self.mu == "auto" or (isinstance(self.mu, (int, float)) and not isinstance(self.mu, bool)
                                   and math.isfinite(self.mu) and self.mu > 0),
             f"mu must be a positive number or 'auto', got {self.mu!r}")
        need(self.proto_dtype in DTYPE_CHOICES and self.adapter_dtype in DTYPE_CHOICES,
             f"proto_dtype/adapter_dtype must be one of {DTYPE_CHOICES}")
        need(self.min_clients >= 1, "min_clients must be >= 1")
        need(self.round_timeout > 0, "round_timeout must be > 0")
        need(self.beta > 0, "beta must be > 0")
        if self.public_classes is not None:
            need(all(isinstance(c, int) and 0 <= c < self.num_classes for c in self.public_classes),
                 f"public_classes must be class ids in [0, {self.num_classes})")
        # Combinations that have no meaning: say so rather than silently ignoring a switch.
        need(not (self.federate == "full" and self.apud), "apud sparsifies the adapter; it needs federate='adapter'")
        # ERPA on unit prototypes (the combined pipeline's candidate (d)): the public-set prototypes travel
        # with the training upload, which equals ERPA's phase 1 of the next round only while nothing
        # federated changes the device's features between the two (protofl/plan.py).
        need(not (self.erpa and self.prototypes == "unit" and self.federate != "none"),
             "erpa on unit prototypes sends its public-set prototypes with the training upload, which is exact "
             "only when no adapter or model is federated: set federate='none' (or prototypes='mean')")
        need(not (self.erpa and self.prototypes == "unit" and self.refine),
             "refinement of ERPA unit anchors is not built: turn refine off (or erpa off for FedPAGR's refinement)")
        need(not (self.cps and self.prototypes == "none"), "cps compresses prototypes; set prototypes='mean'")
        need(not (self.scaling and self.prototypes == "none"), "scaling needs prototypes='mean'")
        # ERPA anchors a public-covered class with the public-set mean; only classes the public set lacks
        # travel as n-weighted prototypes. With every class covered no client sends one, so scaling acts on
        # nothing (measured: identical accuracy on 3 seeds with and without it, bench/results/TABLE.md).
        need(not (self.scaling and self.erpa and len(self.public_class_list) == self.num_classes),
             "scaling changes nothing with erpa when the public set covers every class: every anchor is the "
             "public-set mean, so no client sends an n-weighted prototype; turn scaling off, or list fewer "
             "public_classes (scaling then acts on the others)")
        need(not (self.consensus and self.prototypes != "unit"), "consensus (FedPAGR) needs prototypes='unit'")
        need(not (self.scaling and self.prototypes == "unit"),
             "scaling multiplies mean prototypes by their counts; unit prototypes (FedPAGR) have none: turn scaling off")
        need(not (self.refine and self.prototypes == "unit" and self.cps and self.num_classes * self.s <= self.proto_dim),
             f"refine on spherical CPS prototypes whose masks do not overlap (num_classes * cps_s = "
             f"{self.num_classes * self.s} <= proto_dim = {self.proto_dim}) changes nothing: they are already "
             f"orthogonal; use cps_s > {self.proto_dim // self.num_classes} so that masks overlap, or turn refine off")
        need(not (self.pagr_train_head and not self.consensus),
             "pagr_train_head is FedPAGR's trained-head variant; it needs consensus=true (prototypes='unit')")
        need(not (self.federate == "full" and len(set(self.archs)) > 1),
             "federate='full' (FedAvg) needs one architecture for every client")
        need(not (self.refine and self.prototypes == "none"),
             "refine moves prototypes; with prototypes='none' there is nothing to refine: turn refine off")
        need(not (self.refine and self.prototypes == "mean" and not self.erpa),
             "refine acts on FedPAGR's unit prototypes (prototypes='unit') or on ERPA anchors (erpa=true); "
             "with neither it changes nothing: turn refine off or switch one of them on")
        need(not (self.refine and self.erpa and self.cps and self.num_classes * self.s <= self.proto_dim),
             f"refine with CPS masks that do not overlap (num_classes * cps_s = {self.num_classes * self.s} <= "
             f"proto_dim = {self.proto_dim}) changes nothing: masked anchors are already orthogonal; use "
             f"cps_s > {self.proto_dim // self.num_classes} so that masks overlap, or turn refine off")


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML config file into a dict of overrides (validated when applied)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file '{p}' not found")
    try:
        with p.open("rb") as fh:
            data = tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file '{p}' is not valid TOML: {exc}") from exc
    # Allow either a flat table or a [federation] section.
    return dict(data.get("federation", data))
