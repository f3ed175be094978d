"""Federation configuration: the core fields, plus the options of the techniques the federation uses.

A preset (see `protofl.presets`), a TOML file, `--set` and the Python API give values by name: a core field,
or an option of an installed technique named as its technique's (`tech.alpha`; in a TOML file `"tech.alpha" = 0.5`,
or `alpha = 0.5` in a `[federation.tech]` table), or by its bare name (`alpha`) where one technique declares it
(`resolve_names`). The round plan (protofl.plan) is the one reader of the technique switches.

On the wire, in a state dir and in every artifact the config is *scoped* (`to_dict`): the core fields,
then `techniques`, a map from the name of every technique the federation uses (`registry.active`) to
that technique's options; a technique from another package than protofl-edge also names it, with its
version, under `technique_packages`. A technique the federation does not use sends nothing, so
installing a technique on the server changes no federation that leaves it off, and a device that lacks
it still joins. A device reads the technique names before any option and refuses a federation whose
techniques it lacks with the package to install (`from_dict`), except those the config lists under
`device_free` (a technique that says devices need nothing of it: `Technique.device_free`), which a device
without them reads as if the federation did not use them. Options of a technique the federation
does not use must stay at their defaults (a value given there would be silently dropped, so it is
refused). The flat form that servers before the scoped config sent (every installed option beside the
core fields) is still read.

Each technique declares and checks its own options and combination rules (protofl/technique.py); this
module checks the core fields only.
"""

from __future__ import annotations

import copy
import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 (a Jetson on JetPack 6): the same parser, from PyPI
    import tomli as tomllib

from protofl import participation, privacy, registry
from protofl.errors import ConfigError
from protofl.fields import CORE
from protofl.names import class_key
from protofl.technique import PlanDraft, is_number

FEDERATE_CHOICES = ("full", "adapter", "none")
PROTOTYPE_CHOICES = ("none", "mean", "unit")
DTYPE_CHOICES = ("f4", "f2", "q8")
PROTO_SOURCE_CHOICES = ("after", "during")

SCOPE = "techniques"  # the key of the scoped options in `to_dict`
PACKAGES = "technique_packages"  # technique -> "distribution version", for techniques of other packages
DEVICE_FREE = "device_free"  # the used techniques devices need nothing of (only when there is one)
_TUPLES = ("archs", "in_shape")
# Fields added after devices and reports were in use: they travel (and appear in to_dict) only when set, so a
# federation that leaves them alone sends the config bytes it sent before, and a device of an earlier version,
# which refuses keys it does not know, still joins it.
_ONLY_WHEN_SET = (
    "min_local_steps",
    "drop_last",
    "keep_optimizer",
    "proto_source",
    "class_names",
    "dp_epsilon",
    "dp_delta",
    "dp_clip",
    "dp_noise",
    "dp_mode",
    "secagg",
    "secagg_bound",
    "secagg_dropout",
    "secagg_corrupt",
    *participation.FIELDS,
)


class FederationConfig:
    """A validated, immutable federation config: `cfg.lr` for a core field, `cfg.<option>` (or
    `cfg.options[...]`) for a technique's option. Equal configs have equal `to_dict()`."""

    preset: str
    seed: int
    rounds: int
    archs: tuple[str, ...]
    num_classes: int
    in_shape: tuple[int, int, int]
    proto_dim: int
    adapter_rank: int
    local_epochs: int
    min_local_steps: int
    batch_size: int
    lr: float
    momentum: float
    weight_decay: float
    backbone: str
    drop_last: bool
    keep_optimizer: bool
    proto_source: str
    federate: str
    prototypes: str
    aggregation: str
    proto_lambda: float
    proto_dtype: str
    adapter_dtype: str
    min_clients: int
    round_timeout: float
    public_per_class: int
    public_classes: tuple[int, ...] | None
    class_names: tuple[str, ...] | None
    select: str
    select_target: int
    select_over: float
    select_min: int
    select_fit: bool
    select_compute_s: float
    select_fit_ratio: float
    buffer_k: int
    staleness_bound: int
    dp_epsilon: float | None
    dp_delta: float
    dp_clip: float
    dp_noise: float | None
    dp_mode: str
    secagg: bool
    secagg_bound: float
    secagg_dropout: float | None
    secagg_corrupt: float | None
    options: dict[str, Any]
    techniques: tuple[str, ...]  # the techniques this federation uses, in rule order

    def __init__(self, _unused: str = "refuse", **values: Any) -> None:
        """`values` by name (core fields and options, flat). A value given for an option of a technique this
        federation does not use would be dropped (it does not travel), so it is refused, unless `_unused` is
        "drop" (presets.make_config, where a preset's own value for a technique the user switched off is
        dropped quietly and the user's own are refused or logged there). An option may be named as its
        technique's (`**{"tech.alpha": 0.5}`)."""
        values = resolve_names(values)
        declared = registry.options()
        shadowed = sorted(set(declared) & set(CORE))
        if shadowed:
            raise ConfigError(
                f"technique option(s) {shadowed} have the name of a core field: an installed technique "
                f"must name its options differently"
            )
        unknown = sorted(set(values) - set(CORE) - set(declared))
        if unknown:
            raise ConfigError(f"unknown config key(s) {unknown}; known keys: {sorted(set(CORE) | set(declared))}")
        if values.get("class_names") is not None and "num_classes" not in values:
            names = values["class_names"]
            values = dict(values, num_classes=len(names.split(",") if isinstance(names, str) else names))
        for key, default in CORE.items():
            value = values.get(key, default)
            if (key in _TUPLES or key in ("public_classes", "class_names")) and isinstance(value, list):
                value = tuple(value)
            if key == "class_names" and isinstance(value, str):  # --set class_names=a,b,c
                value = tuple(n.strip() for n in value.split(","))
            object.__setattr__(self, key, value)
        opts = {}
        for key, opt in declared.items():
            value = values.get(key, opt.default)
            opts[key] = tuple(value) if isinstance(value, list) else value
        object.__setattr__(self, "options", opts)
        self._validate()
        active = registry.active(self)
        object.__setattr__(self, "techniques", tuple(t.name for t in active))
        # An unused technique's options are its defaults: they do not travel (`to_dict`).
        stray = self.unused_options(values)
        if stray and _unused != "drop":
            raise ConfigError(unused_message(stray, self.techniques))
        owners = registry.owners()
        for key, opt in declared.items():
            if owners[key] not in self.techniques:
                opts[key] = opt.default
        # The techniques' own checks and combination rules, and the round plan they shape: made once, here; the
        # plan (protofl.plan.RoundPlan.from_config) reads this draft instead of shaping it again.
        object.__setattr__(self, "_draft", registry.draft(self))
        privacy.check(self, self.__dict__["_draft"])
        privacy.check_secagg(self, self.__dict__["_draft"])
        if self.dp_epsilon is not None and self.dp_noise is None:
            # Resolved here, so that the config message carries it: a device adds the noise it is told.
            object.__setattr__(self, "dp_noise", privacy.calibrate(float(self.dp_epsilon), self.dp_delta, self.rounds))
        assert tuple(t.name for t in registry.active(self)) == self.techniques

    @property
    def draft(self) -> PlanDraft:
        """The round plan as the used techniques shaped it for this config (RoundPlan.from_config reads it)."""
        return copy.deepcopy(self.__dict__["_draft"])

    def unused_options(self, given: Mapping[str, Any]) -> list[str]:
        """The names in `given` that are options of techniques this federation does not use, set away from their
        defaults (a user's values that would be dropped)."""
        declared, owners = registry.options(), registry.owners()
        return sorted(
            key
            for key, value in given.items()
            if key in owners and owners[key] not in self.techniques and _plain(value) != _plain(declared[key].default)
        )

    def __getattr__(self, name: str) -> Any:
        # Only reached for names that are not core fields: a technique's option.
        opts = self.__dict__.get("options")
        if opts is not None and name in opts:
            return opts[name]
        raise AttributeError(f"config has no field or technique option '{name}'")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("FederationConfig is immutable: use cfg.replace(...)")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FederationConfig) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(repr(sorted(self.to_dict().items())))

    def __repr__(self) -> str:
        changed = {k: v for k, v in self.values().items() if v != _default(k)}
        return f"FederationConfig({', '.join(f'{k}={v!r}' for k, v in changed.items())})"

    def __reduce__(self) -> tuple[Any, ...]:  # copy.deepcopy and friends: rebuild from the values
        return (_from_values, (self.values(),))

    def arch_for(self, client_index: int) -> str:
        return self.archs[client_index % len(self.archs)]

    # -- (de)serialisation ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The scoped form (the module's docstring): core fields, then the used techniques' options."""
        out: dict[str, Any] = {}
        for key in CORE:
            value = getattr(self, key)
            if key in _ONLY_WHEN_SET and value == CORE[key]:
                continue
            out[key] = _plain(value)
        owners = registry.owners()
        declared = registry.options()
        out[SCOPE] = {
            name: {
                k: _plain(v)
                for k, v in self.options.items()
                if owners[k] == name and not (declared[k].only_when_set and _plain(v) == _plain(declared[k].default))
            }
            for name in self.techniques
        }
        packages = {name: p for name in self.techniques if (p := registry.package(name)) is not None}
        if packages:
            out[PACKAGES] = packages
        free = [name for name in self.techniques if registry.technique(name).device_free]
        if free:
            out[DEVICE_FREE] = free
        return out

    def values(self) -> dict[str, Any]:
        """Every value by name, flat (core fields and every installed option): what `replace` starts from."""
        out = {key: _plain(getattr(self, key)) for key in CORE}
        out.update({key: _plain(v) for key, v in self.options.items()})
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, unused: str = "refuse") -> FederationConfig:
        """A config from its scoped form (`to_dict`), or from flat values (a preset's, a file's, or the
        config message of a server before the scoped form). The technique names are checked against the
        installed techniques before any option is read."""
        if "_unused" in data:
            raise ConfigError("unknown config key(s) ['_unused']")
        kwargs: dict[str, Any] = dict(data, _unused=unused)
        if isinstance(kwargs.get("archs"), str):
            kwargs["archs"] = tuple(a for a in kwargs["archs"].split(",") if a)
        packages = kwargs.pop(PACKAGES, None)
        free = kwargs.pop(DEVICE_FREE, None) or []
        if not isinstance(free, list) or not all(isinstance(n, str) for n in free):
            raise ConfigError(f"config '{DEVICE_FREE}' must be a list of technique names, got {free!r}")
        if SCOPE not in kwargs:
            return cls(**kwargs)
        scoped = kwargs.pop(SCOPE)
        if not isinstance(scoped, dict) or not all(
            isinstance(k, str) and isinstance(v, dict) for k, v in scoped.items()
        ):
            raise ConfigError(f"config '{SCOPE}' must map technique names to their options, got {scoped!r}")
        installed = {t.name for t in registry.techniques()}
        # A technique that devices need nothing of, not installed here: read as if the federation left it off.
        scoped = {name: opts for name, opts in scoped.items() if name in installed or name not in free}
        missing = [name for name in scoped if name not in installed]
        skipped = [registry.skipped()[name].message() for name in missing if name in registry.skipped()]
        if skipped:
            raise ConfigError(f"this federation uses technique(s) {missing}: {'; '.join(skipped)}")
        if missing:
            named = packages if isinstance(packages, dict) else {}
            what = "; ".join(
                f"'{n}' comes from {named[n]}: pip install '{_requirement(named[n])}'"
                if isinstance(named.get(n), str)
                else f"'{n}' is not a technique of protofl-edge: "
                f"install the package that provides it (entry point group {registry.GROUP})"
                for n in missing
            )
            raise ConfigError(
                f"this federation uses technique(s) {missing} that are not installed here: {what}; "
                f"installed: {sorted(installed)}"
            )
        owners = registry.owners()
        for name, opts in scoped.items():
            for key, value in opts.items():
                if owners.get(key) != name:
                    raise ConfigError(
                        f"config '{SCOPE}.{name}.{key}': technique '{name}' has no option '{key}' "
                        f"here (its options: {sorted(k for k, o in owners.items() if o == name)}); "
                        f"the server may run another version of it: install the same version here"
                    )
                if key in kwargs:
                    raise ConfigError(f"config option '{key}' is given twice (flat and under '{SCOPE}.{name}')")
                kwargs[key] = value
        cfg = cls(**kwargs)
        if set(cfg.techniques) != set(scoped):  # (a saved copy may have sorted the names)
            raise ConfigError(
                f"the config names technique(s) {list(scoped)}, but its values switch on "
                f"{list(cfg.techniques)} here: this device runs other versions of the techniques "
                f"than the server; install the server's versions"
            )
        return cfg

    def replace(self, **changes: Any) -> FederationConfig:
        return FederationConfig(**{**self.values(), **resolve_names(changes)})

    # -- validation of the core fields -----------------------------------------------------------
    def _validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        for name in (
            "seed",
            "rounds",
            "num_classes",
            "proto_dim",
            "adapter_rank",
            "local_epochs",
            "min_local_steps",
            "batch_size",
            "min_clients",
        ):
            value = getattr(self, name)
            need(
                isinstance(value, int) and not isinstance(value, bool),
                f"config '{name}' must be an integer, got {value!r}",
            )
        for name in ("lr", "momentum", "weight_decay", "proto_lambda", "round_timeout"):
            value = getattr(self, name)
            need(is_number(value), f"config '{name}' must be a finite number, got {value!r}")
        need(self.rounds >= 1, f"rounds must be >= 1, got {self.rounds}")
        need(2 <= self.num_classes <= 65535, f"num_classes must be in [2, 65535], got {self.num_classes}")
        need(1 <= self.proto_dim <= 65536, f"proto_dim must be in [1, 65536], got {self.proto_dim}")
        need(
            1 <= self.adapter_rank <= self.proto_dim,
            f"adapter_rank must be in [1, proto_dim={self.proto_dim}], got {self.adapter_rank}",
        )
        need(self.local_epochs >= 1 and self.batch_size >= 1, "local_epochs and batch_size must be >= 1")
        need(
            0 <= self.min_local_steps <= 100_000,
            f"min_local_steps must be in [0, 100000] (0: no floor, local_epochs alone), got {self.min_local_steps}",
        )
        need(self.lr > 0, f"lr must be > 0, got {self.lr}")
        need(
            isinstance(self.archs, tuple)
            and len(self.archs) >= 1
            and all(isinstance(a, str) and a for a in self.archs),
            f"archs must be a non-empty list of architectures (built-in names, package.module:factory or "
            f"protofl.models names), got {self.archs!r}",
        )
        need(
            isinstance(self.in_shape, tuple)
            and len(self.in_shape) == 3
            and all(isinstance(v, int) and v > 0 for v in self.in_shape),
            f"in_shape must be (channels, height, width), got {self.in_shape!r}; e.g. --set in_shape=3,32,32 "
            f"or in_shape = [3, 32, 32] in a config file",
        )
        need(self.backbone in ("train", "frozen"), f"backbone must be 'train' or 'frozen', got {self.backbone!r}")
        for name in ("drop_last", "keep_optimizer"):
            value = getattr(self, name)
            need(isinstance(value, bool), f"config '{name}' must be true or false, got {value!r}")
        need(
            self.proto_source in PROTO_SOURCE_CHOICES,
            f"proto_source must be one of {PROTO_SOURCE_CHOICES}, got {self.proto_source!r}",
        )
        need(self.federate in FEDERATE_CHOICES, f"federate must be one of {FEDERATE_CHOICES}, got {self.federate!r}")
        need(
            self.prototypes in PROTOTYPE_CHOICES,
            f"prototypes must be one of {PROTOTYPE_CHOICES}, got {self.prototypes!r}",
        )
        need(self.aggregation in ("weighted", "mean"), "aggregation must be 'weighted' or 'mean'")
        need(
            self.proto_dtype in DTYPE_CHOICES and self.adapter_dtype in DTYPE_CHOICES,
            f"proto_dtype/adapter_dtype must be one of {DTYPE_CHOICES}",
        )
        need(self.min_clients >= 1, "min_clients must be >= 1")
        need(self.round_timeout > 0, "round_timeout must be > 0")
        need(
            not (self.federate == "full" and len(set(self.archs)) > 1),
            "federate='full' (FedAvg) needs one architecture for every client",
        )
        need(
            isinstance(self.public_per_class, int)
            and not isinstance(self.public_per_class, bool)
            and self.public_per_class >= 0,
            f"public_per_class must be an integer >= 0, got {self.public_per_class!r}",
        )
        need(
            self.public_classes is None
            or (
                isinstance(self.public_classes, tuple)
                and all(
                    isinstance(c, int) and not isinstance(c, bool) and 0 <= c < self.num_classes
                    for c in self.public_classes
                )
            ),
            f"public_classes must be a list of class ids in [0, {self.num_classes}), got {self.public_classes!r}",
        )
        self._validate_class_names()
        for trouble in participation.check({k: getattr(self, k) for k in participation.FIELDS}):
            need(False, trouble)
        problems = privacy.check_numbers(self)
        need(not problems, "; ".join(problems))
        need(isinstance(self.secagg, bool), f"secagg must be true or false, got {self.secagg!r}")
        need(
            isinstance(self.secagg_bound, (int, float))
            and not isinstance(self.secagg_bound, bool)
            and math.isfinite(self.secagg_bound)
            and self.secagg_bound > 0,
            f"secagg_bound must be a number > 0, got {self.secagg_bound!r}",
        )
        for key in ("secagg_dropout", "secagg_corrupt"):
            rate = getattr(self, key)
            need(
                rate is None or (is_number(rate) and 0 <= rate < 1),
                f"{key} must be a fraction of the devices in [0, 1), got {rate!r}",
            )
            need(rate is None or self.secagg is True, f"{key} is secure aggregation's threat model: set secagg=true")
        for key, opt in registry.options().items():
            problem = opt.check(self.options[key]) if opt.check is not None else None
            need(problem is None, str(problem))

    def _validate_class_names(self) -> None:
        names = self.class_names
        if names is None:
            return
        if not (isinstance(names, tuple) and all(isinstance(n, str) and n.strip() for n in names)):
            raise ConfigError(f"class_names must be a list of non-empty names, one per class id, got {names!r}")
        if len(names) != self.num_classes:
            raise ConfigError(
                f"class_names has {len(names)} names but the federation has num_classes={self.num_classes}: "
                f"one name per class id 0..{self.num_classes - 1}"
            )
        seen: dict[str, str] = {}
        for name in names:
            key = class_key(name)
            if key in seen:
                raise ConfigError(
                    f"class_names {seen[key]!r} and {name!r} name the same class (a class folder's name is matched "
                    f"ignoring case, spaces and punctuation): give every class a distinct name"
                )
            seen[key] = name


def resolve_names(values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` with every option under its bare name: `tech.alpha` (or a table `tech = {alpha = ...}`, as a TOML
    file's `[federation.tech]` reads) becomes `alpha`; a bare name is kept where one technique declares it
    (registry.option_name says what is wrong otherwise). A name given twice (`alpha`, `tech.alpha`) is refused."""
    out: dict[str, Any] = {}
    spelt: dict[str, str] = {}
    names = {t.name for t in registry.techniques()} | set(registry.skipped())
    flat: list[tuple[str, Any]] = []
    for key, value in values.items():
        if isinstance(value, dict) and key in names:
            flat += [(f"{key}.{k}", v) for k, v in value.items()]
        else:
            flat.append((key, value))
    for key, value in flat:
        name = key if key in CORE else registry.option_name(key)
        if name in out:
            raise ConfigError(f"config option '{name}' is given twice (as '{spelt[name]}' and '{key}'): give it once")
        out[name], spelt[name] = value, key
    return out


def _default(key: str) -> Any:
    return _plain(CORE[key] if key in CORE else registry.options()[key].default)


def unused_message(stray: list[str], used: tuple[str, ...], *, advice: bool = True) -> str:
    """What is wrong with values given for options of techniques a federation does not use (`advice`: and what
    to do about it)."""
    owners = registry.owners()
    what = (
        f"option(s) {stray} belong to technique(s) {sorted({owners[k] for k in stray})} that this federation "
        f"does not use (it uses {list(used) or 'none'})"
    )
    return f"{what}: switch the technique on, or drop the option(s)" if advice else what


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _requirement(package: str) -> str:
    """'name version' (as `to_dict` names a package) as a pip requirement."""
    name, _, version = package.partition(" ")
    return f"{name}=={version}" if version else name


def canonical(data: dict[str, Any]) -> dict[str, Any]:
    """A saved config (scoped, or flat as saved before the scoped form) in today's scoped form, for comparing
    a state dir's or a checkpoint's config with a running federation's."""
    return FederationConfig.from_dict(data).to_dict()


def _from_values(values: dict[str, Any]) -> FederationConfig:
    return FederationConfig(**values)


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
