"""The technique registry: every technique installed, found through the `protofl.techniques` entry points.

The built-in techniques register exactly as a third-party package does (pyproject.toml), so this module
names none of them. A package that brings its own technique declares, in its own pyproject.toml:

    [project.entry-points."protofl.techniques"]
    mytech = "my_package.server:MyTechnique"        # a protofl.technique.Technique (numpy)
    [project.entry-points."protofl.device_rules"]
    mytech = "my_package.device:MyDeviceRule"        # an edge_agent.techniques.DeviceRule (torch)

and is installed on the server and on the devices (on the server alone where it says `device_free`).

A third-party technique cannot take a federation down that does not use it: one that does not import,
clashes with what is installed before it (its name, an option or a preset another technique or a core
field has) or misbehaves on the default config (switches itself on there, or its `check` raises) is named
in a warning, once, and skipped. A federation that names it (its switch, an option, a preset, a config
message) gets a ConfigError that says why it was skipped. protofl-edge's own techniques are loaded first
and never skipped: a broken install of the package itself is an error.

Options are named as their technique's: `tech.alpha`, or the bare `alpha` where one technique declares it
(`option_name`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Any

from protofl.errors import ConfigError
from protofl.fields import CORE
from protofl.technique import Option, Phase, PlanDraft, Technique, Upload

if TYPE_CHECKING:
    from protofl.config import FederationConfig

GROUP = "protofl.techniques"
OWN_DIST = "protofl-edge"  # the distribution whose techniques need no package named in a config
OWN = "(own)"
# Keys of a config's scoped form (protofl/config.py) that no technique may be named as.
RESERVED = frozenset({"techniques", "technique_packages", "device_free"})

log = logging.getLogger("protofl.registry")


@dataclass(frozen=True)
class Skipped:
    """A third-party technique the registry left out, and why: what a federation that names it is told."""

    name: str
    source: str  # "name = module:attr (distribution version)"
    why: str
    options: tuple[str, ...] = ()  # what it declares, where it loaded far enough to say
    presets: tuple[str, ...] = ()

    def message(self) -> str:
        return (
            f"technique '{self.name}' ({self.source}) is installed but was skipped: {self.why}; "
            f"fix or uninstall the package that brings it"
        )


@dataclass(frozen=True)
class _Installed:
    techniques: dict[str, tuple[Technique, str | None]]  # name -> (technique, its package), in plan order
    skipped: dict[str, Skipped]


@functools.cache
def techniques() -> tuple[Technique, ...]:
    """Every installed technique that loaded, in plan order (their `order`, then name)."""
    return tuple(tech for tech, _ in _found().techniques.values())


def skipped() -> dict[str, Skipped]:
    """The third-party techniques that are installed but were skipped, by name."""
    return _found().skipped


def package(name: str) -> str | None:
    """'distribution version' of the package that brings technique `name`, or None for protofl-edge's own."""
    dist = _found().techniques[name][1]
    return None if dist is None or dist == OWN else dist


def technique(name: str) -> Technique:
    found = _found()
    if name in found.techniques:
        return found.techniques[name][0]
    if name in found.skipped:
        raise ConfigError(found.skipped[name].message())
    raise ConfigError(f"technique '{name}' is not installed; installed: {', '.join(t.name for t in techniques())}")


@functools.cache
def options() -> dict[str, Option]:
    """Every option the loaded techniques declare, by its bare name (a name is declared once: `_found`)."""
    return {key: opt for tech in techniques() for key, opt in tech.options.items()}


@functools.cache
def owners() -> dict[str, str]:
    """Option name -> the technique that declares it."""
    return {key: tech.name for tech in techniques() for key in tech.options}


def option_name(key: str) -> str:
    """The option a name given by a user means (`--set`, a config file, the Python API): `tech.option`
    qualified by its technique, or a bare name that one technique declares; a name that is neither is
    returned as it is (a core field, or unknown: the config says so). ConfigError for a name that needs
    a skipped technique, an unknown technique or option, or a bare name that several techniques declare."""
    tech, dot, opt = key.partition(".")
    found = _found()
    if dot:
        if tech in found.skipped:
            raise ConfigError(f"config '{key}': {found.skipped[tech].message()}")
        if tech not in found.techniques:
            raise ConfigError(
                f"config '{key}' names technique '{tech}', which is not installed; installed: "
                f"{', '.join(found.techniques)}"
            )
        declared = found.techniques[tech][0].options
        if opt not in declared:
            raise ConfigError(
                f"config '{key}': technique '{tech}' has no option '{opt}'; its options: {sorted(declared)}"
            )
        return opt
    candidates = [name for name, (t, _) in found.techniques.items() if key in t.options]
    if len(candidates) > 1:
        raise ConfigError(
            f"config option '{key}' is declared by {candidates}: name the one you mean as "
            f"{' or '.join(f'{c}.{key}' for c in candidates)}"
        )
    if not candidates and key not in CORE:
        for s in found.skipped.values():
            if key in s.options or key == s.name:
                raise ConfigError(f"config '{key}': {s.message()}")
    return key


@functools.cache
def presets() -> dict[str, Mapping[str, Any]]:
    """Every preset the loaded techniques bring: name -> config values."""
    return {name: values for tech in techniques() for name, values in tech.presets.items()}


def skipped_preset(name: str) -> Skipped | None:
    """The skipped technique that brings preset `name`, if one does."""
    return next((s for s in _found().skipped.values() if name in s.presets), None)


def active(cfg: FederationConfig) -> tuple[Technique, ...]:
    return tuple(t for t in techniques() if t.active(cfg))


def draft(cfg: FederationConfig) -> PlanDraft:
    """Check the used techniques' combination rules and let them shape the round plan."""
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
    used = active(cfg)
    for tech in used:  # only the federation's own: an unused technique's options are its defaults here
        _checked(tech, cfg)
    for tech in used:
        tech.shape(d, cfg)
    return d


def _checked(tech: Technique, cfg: Any) -> None:
    """`tech.check(cfg)`; a third-party check that fails with anything but a ConfigError names its technique."""
    try:
        tech.check(cfg)
    except ConfigError:
        raise
    except Exception as exc:
        if package(tech.name) is None:
            raise
        raise ConfigError(
            f"technique '{tech.name}' ({package(tech.name)}) failed checking this config: "
            f"{type(exc).__name__}: {exc}; fix or uninstall the package that brings it"
        ) from exc


def reload() -> None:
    """Forget what was found (after installing a technique into a running interpreter, e.g. in tests)."""
    _found.cache_clear()
    techniques.cache_clear()
    options.cache_clear()
    owners.cache_clear()
    presets.cache_clear()


# -- loading ------------------------------------------------------------------------------------------------------
def _dist(ep: EntryPoint) -> str | None:
    dist = getattr(ep, "dist", None)
    return None if dist is None else (OWN if dist.name == OWN_DIST else f"{dist.name} {dist.version}")


@functools.cache
def _found() -> _Installed:
    eps = list(entry_points(group=GROUP))
    own = [ep for ep in eps if _dist(ep) in (OWN, None)]
    others = sorted((ep for ep in eps if _dist(ep) not in (OWN, None)), key=lambda ep: (ep.name, ep.value))
    found: dict[str, tuple[Technique, str | None, EntryPoint]] = {}
    for ep in own:
        if ep.name not in found:  # (a checkout seen twice on the path lists its entry points twice)
            found[ep.name] = (_load_own(ep), _dist(ep), ep)
    skipped: dict[str, Skipped] = {}
    for ep in others:
        if ep.name in found and found[ep.name][2].value == ep.value:
            continue
        source = f"{ep.name} = {ep.value} ({_dist(ep)})"
        tech, why = _load(ep, found)
        if tech is None:
            s = Skipped(ep.name, source, why)
        else:
            why = why or _misbehaves(tech, [t for t, _, _ in found.values()])
            s = Skipped(ep.name, source, why, tuple(tech.options), tuple(tech.presets))
        if s.why:
            if ep.name not in skipped:
                skipped[ep.name] = s
                log.warning("%s", s.message())
            continue
        assert tech is not None
        found[ep.name] = (tech, _dist(ep), ep)
    if not found:
        raise ConfigError(
            f"no technique is registered in the entry-point group {GROUP}: the package metadata is "
            f"missing; reinstall it (pip install -e . in a checkout)"
        )
    ordered = sorted((t for t, _, _ in found.values()), key=lambda t: (t.order, t.name))
    return _Installed({t.name: (t, found[t.name][1]) for t in ordered}, skipped)


def _instance(ep: EntryPoint) -> Technique:
    obj = ep.load()
    return obj() if isinstance(obj, type) else obj


def _load_own(ep: EntryPoint) -> Technique:
    """One of protofl-edge's own techniques: a failure is a broken install, said as such."""
    try:
        tech = _instance(ep)
    except Exception as exc:
        raise ConfigError(
            f"technique '{ep.name} = {ep.value}' (entry point group {GROUP}) does not load: "
            f"{type(exc).__name__}: {exc}; fix or uninstall the package that brings it"
        ) from exc
    if not isinstance(tech, Technique) or tech.name != ep.name:
        raise ConfigError(
            f"entry point '{ep.name} = {ep.value}' in group {GROUP} is not the protofl Technique '{ep.name}'"
        )
    return tech


def _load(
    ep: EntryPoint, found: Mapping[str, tuple[Technique, str | None, EntryPoint]]
) -> tuple[Technique | None, str]:
    """A third-party technique, and why it cannot be used ("" where it can), judged against those `found`."""
    if ep.name in found:
        return None, f"a technique named '{ep.name}' is installed already ({found[ep.name][2].value})"
    if ep.name in CORE or ep.name in RESERVED or "." in ep.name:
        return None, f"its name '{ep.name}' is a config field's (or has a '.'): rename the technique"
    try:
        tech = _instance(ep)
    except Exception as exc:
        return None, f"it does not load (entry point group {GROUP}): {type(exc).__name__}: {exc}"
    if not isinstance(tech, Technique):
        return None, f"entry point '{ep.name} = {ep.value}' in group {GROUP} is not a protofl Technique"
    if tech.name != ep.name:
        return None, f"entry point '{ep.name}' registers a technique named '{tech.name}'; use one name"
    owner = {key: t.name for t, _, _ in found.values() for key in t.options}
    for key in tech.options:
        if key in CORE or key in RESERVED or "." in key:
            return tech, f"its option '{key}' has the name of a core config field (or a '.'): rename the option"
        if key in owner:
            return tech, f"its option '{key}' is declared by '{owner[key]}' too: rename the option"
    brought = {name: t.name for t, _, _ in found.values() for name in t.presets}
    for name in tech.presets:
        if name in brought:
            return tech, f"its preset '{name}' is brought by '{brought[name]}' too: rename the preset"
    return tech, ""


class _Defaults:
    """The default config as a technique reads it (core fields and every option at its default, no technique
    used), without FederationConfig: what a third-party technique is tried on when it is loaded."""

    def __init__(self, options: Mapping[str, Option]) -> None:
        self.__dict__.update(CORE)
        self.options = {key: opt.default for key, opt in options.items()}
        self.techniques: tuple[str, ...] = ()

    def __getattr__(self, name: str) -> Any:
        opts = self.__dict__["options"]
        if name in opts:
            return opts[name]
        raise AttributeError(f"config has no field or technique option '{name}'")


def _misbehaves(tech: Technique, loaded: list[Technique]) -> str:
    """Why `tech` would change or break federations that leave it off ("" where it would not): it is tried on
    the default config, where it must be off and its `check` must pass."""
    cfg = _Defaults({key: opt for t in [*loaded, tech] for key, opt in t.options.items()})
    try:
        if tech.active(cfg):  # type: ignore[arg-type]
            return "it switches itself on in a federation that leaves it off (its `active` on the default config)"
        tech.check(cfg)  # type: ignore[arg-type]
    except Exception as exc:
        return f"its check fails on the default config, where it is off: {type(exc).__name__}: {exc}"
    return ""
