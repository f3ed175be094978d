"""Presets: each a set of config values (a technique's switches and options), nothing else.

The built-in ones are below; an installed technique may bring more (`Technique.presets`).

fedavg      FedAvg (McMahan et al. 2017): every parameter federated, dense.
fedproto    FedProto (Tan et al. 2022): prototypes only, weighted global prototypes, CE + lambda*MSE.
refprotofl  RefProtoFL (paper 000): ERPA anchors from a public set + APUD top-K adapter uploads.
tinyproto   TinyProto-FP (paper 002): FedProto + CPS (s = m/10) + prototype scaling, mu = "auto" (the paper's
            mu = 1.5e-4, tuned for CIFAR-10, shrinks Fashion-MNIST targets to ~0: replacing every target by 0
            reproduced such a run exactly; docs/algorithms.md, TinyProto). `--set mu=1.5e-4` is the paper's value.
            proto_lambda = 0.1 (FedProto's is 1): the benchmark's CPS lambda sweep chose it on seed 0 of setting
            A and it beat lambda = 1 on seeds 0-2 by +2.06 points of global accuracy [+0.98, +3.13] (TABLE.md,
            lambda sweep); `--set proto_lambda=1` is the old value.
fedpagr     FedPAGR (paper 004): consensus projection, unit prototypes, geometric refinement.
protofl     The combined pipeline as the ablation benchmark chose it (docs/algorithms.md: "decided by the
            ablation benchmark, not by taste"; bench/results/TABLE.md, "Default of the protofl preset"):
            candidate (b), spherical CPS: FedPAGR's client objective (consensus projection, unit
            prototypes, anchored head, cosine logits, entropy term) on CPS-masked unit prototypes, so a
            round uploads TinyProto's bytes (s = m/10 values per class). Nothing else is federated: no
            adapters, no ERPA, no refinement (disjoint masks make it a no-op; with `cps_s=128` the masks
            overlap and `--set refine=true` acts). The rule picked it over (a) CPS + ERPA + APUD and the
            others on 3 seeds; FedPAGR (full 512-d prototypes, about 9x the bytes) beats it on B's local
            accuracy by 0.86 points [+0.01, +1.70] on 5 seeds (TABLE.md: goal 4 missed, narrowly).
"""

from __future__ import annotations

import logging
from typing import Any

from protofl import registry
from protofl.config import FederationConfig, load_config_file, resolve_names, unused_message
from protofl.errors import ConfigError

log = logging.getLogger("protofl.config")

PRESETS: dict[str, dict[str, Any]] = {
    "fedavg": dict(federate="full", prototypes="none"),
    "fedproto": dict(federate="none", prototypes="mean", aggregation="weighted"),
    "refprotofl": dict(federate="adapter", prototypes="mean", erpa=True, apud=True),
    # proto_lambda 0.1, not FedProto's 1: the benchmark's lambda sweep decided it (docs/algorithms.md, TinyProto)
    "tinyproto": dict(federate="none", prototypes="mean", cps=True, scaling=True, mu="auto", proto_lambda=0.1),
    "fedpagr": dict(federate="none", prototypes="unit", consensus=True, refine=True),
    # mu only acts with scaling (off here); "auto" is what `--set scaling=true` on mean prototypes wants
    "protofl": dict(
        federate="none",
        prototypes="unit",
        consensus=True,
        erpa=False,
        apud=False,
        cps=True,
        scaling=False,
        refine=False,
        mu="auto",
        # The deployable global predictor (issue 41): a ridge head on the shared backbone, solved from statistics
        # each device sends once (protofl/algorithms/ridge.py; bench/results/PREDICTOR.md chose it).
        ridge=True,
    ),
}


def all_presets() -> dict[str, dict[str, Any]]:
    """The built-in presets and those the installed techniques bring (a built-in name stays the built-in's)."""
    brought = {name: dict(values) for name, values in registry.presets().items() if name not in PRESETS}
    return {**PRESETS, **brought}


def preset_names() -> list[str]:
    return list(all_presets())


def make_config(
    preset: str, config_file: str | None = None, /, *, strict: bool = False, **overrides: Any
) -> FederationConfig:
    """Build a validated config: preset switches, then a TOML file's values, then explicit overrides (an option by
    its bare name or as its technique's: `make_config("tinyproto", **{"cps.mu": 1.5e-4})`).

    A value given (in the file or the overrides) for an option of a technique the federation does not use
    is dropped (the technique's default stands: it does not travel): `strict` refuses it (`start` does, for
    its --set and --config), else it is logged as a warning."""
    presets = all_presets()
    named = overrides.pop("preset", None)
    if named is not None and named != preset:
        # The config's `preset` records where its values came from; a --set or a file cannot change it.
        raise ConfigError(
            f"the preset is chosen with --preset {named} (or make_config('{named}', ...)), not as a "
            f"config value; this run's preset is '{preset}'"
        )
    if preset not in presets:
        skipped = registry.skipped_preset(preset)
        if skipped is not None:
            raise ConfigError(f"preset '{preset}': {skipped.message()}")
        raise ConfigError(f"preset '{preset}' not found; known: {', '.join(presets)}")
    values: dict[str, Any] = {"preset": preset, **resolve_names(presets[preset])}
    from_file: dict[str, Any] = {}
    if config_file:
        from_file = resolve_names(load_config_file(config_file))
        if from_file.get("preset", preset) != preset:
            raise ConfigError(
                f"config file '{config_file}' says preset = '{from_file['preset']}', but this run's "
                f"preset is '{preset}': choose it with --preset, or remove the key from the file"
            )
        values.update(from_file)
    given = resolve_names({k: v for k, v in overrides.items() if v is not None})
    values.update(given)
    cfg = FederationConfig.from_dict(values, unused="drop")
    stray = cfg.unused_options({**from_file, **given})
    if stray:
        if strict:
            raise ConfigError(unused_message(stray, cfg.techniques))
        log.warning("%s: ignored", unused_message(stray, cfg.techniques, advice=False))
    return cfg
