"""The technique registry: every technique installed, found through the `protofl.techniques` entry points.

The built-in techniques register exactly as a third-party package does (pyproject.toml), so this module
names none of them. A package that brings its own technique declares, in its own pyproject.toml:

    [project.entry-points."protofl.techniques"]
    mytech = "my_package.server:MyTechnique"        # a protofl.technique.Technique (numpy)
    [project.entry-points."protofl.device_rules"]
    mytech = "my_package.device:MyDeviceRule"        # an edge_agent.techniques.DeviceRule (torch)

and is installed on the server and on the devices.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from protofl.errors import ConfigError
from protofl.technique import Option, Phase, PlanDraft, Technique, Upload

if TYPE_CHECKING:
    from protofl.config import FederationConfig

GROUP = "protofl.techniques"
OWN_DIST = "protofl-edge"  # the distribution whose techniques need no package named in a config
OWN = "(own)"


@functools.cache
def techniques() -> tuple[Technique, ...]:
    """Every installed technique, in plan order (their `order`, then name)."""
    return tuple(tech for tech, _ in _found().values())


def package(name: str) -> str | None:
    """'distribution version' of the package that brings technique `name`, or None for protofl-edge's own."""
    dist = _found()[name][1]
    return None if dist is None or dist == OWN else dist


@functools.cache
def _found() -> dict[str, tuple[Technique, str | None]]:
    found: dict[str, Technique] = {}
    dists: dict[str, str | None] = {}
    for ep in entry_points(group=GROUP):
        try:
            obj = ep.load()
            tech = obj() if isinstance(obj, type) else obj
        except Exception as exc:  # a broken third-party package: say which, not a bare traceback
            raise ConfigError(
                f"technique '{ep.name} = {ep.value}' (entry point group {GROUP}) does not load: "
                f"{type(exc).__name__}: {exc}; fix or uninstall the package that brings it"
            ) from exc
        if not isinstance(tech, Technique):
            raise ConfigError(f"entry point '{ep.name} = {ep.value}' in group {GROUP} is not a protofl Technique")
        if tech.name != ep.name:
            raise ConfigError(f"entry point '{ep.name}' registers a technique named '{tech.name}'; use one name")
        if ep.name not in found:
            found[ep.name] = tech
            dist = getattr(ep, "dist", None)
            dists[ep.name] = None if dist is None else (OWN if dist.name == OWN_DIST else f"{dist.name} {dist.version}")
    if not found:
        raise ConfigError(
            f"no technique is registered in the entry-point group {GROUP}: the package metadata is "
            f"missing; reinstall it (pip install -e . in a checkout)"
        )
    ordered = sorted(found.values(), key=lambda t: (t.order, t.name))
    return {t.name: (t, dists[t.name]) for t in ordered}


def technique(name: str) -> Technique:
    for tech in techniques():
        if tech.name == name:
            return tech
    raise ConfigError(f"technique '{name}' is not installed; installed: {', '.join(t.name for t in techniques())}")


@functools.cache
def options() -> dict[str, Option]:
    """Every option the installed techniques declare (a name is declared once)."""
    out: dict[str, Option] = {}
    owner: dict[str, str] = {}
    for tech in techniques():
        for key, opt in tech.options.items():
            if key in owner:
                raise ConfigError(f"config option '{key}' is declared by both '{owner[key]}' and '{tech.name}'")
            out[key], owner[key] = opt, tech.name
    return out


@functools.cache
def owners() -> dict[str, str]:
    """Option name -> the technique that declares it."""
    return {key: tech.name for tech in techniques() for key in tech.options}


@functools.cache
def presets() -> dict[str, Mapping[str, Any]]:
    """Every preset the installed techniques bring: name -> config values."""
    out: dict[str, Mapping[str, Any]] = {}
    for tech in techniques():
        for name, values in tech.presets.items():
            if name in out:
                raise ConfigError(f"preset '{name}' is brought by two techniques")
            out[name] = values
    return out


def active(cfg: FederationConfig) -> tuple[Technique, ...]:
    return tuple(t for t in techniques() if t.active(cfg))


def draft(cfg: FederationConfig) -> PlanDraft:
    """Check the active techniques' combination rules and let them shape the round plan."""
    d = PlanDraft(
        num_classes=cfg.num_classes,
        proto_dim=cfg.proto_dim,
        federate=cfg.federate,
        prototypes=cfg.prototypes,
        proto_dtype=cfg.proto_dtype,
        adapter_dtype=cfg.adapter_dtype,
        proto_width=cfg.proto_dim,
    )
    train: list[Upload] = []
    if cfg.federate != "none":
        train.append(Upload.ADAPTER)
    if cfg.prototypes != "none":
        train.append(Upload.PROTOS)
    d.uploads = {Phase.TRAIN: tuple(train)}
    for tech in techniques():  # a switch that is set where it means nothing is refused too
        tech.check(cfg)
    for tech in active(cfg):
        tech.shape(d, cfg)
    return d


def reload() -> None:
    """Forget what was found (after installing a technique into a running interpreter, e.g. in tests)."""
    _found.cache_clear()
    techniques.cache_clear()
    options.cache_clear()
    owners.cache_clear()
    presets.cache_clear()
