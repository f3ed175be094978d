"""Who takes part in a run, and rounds that do not wait for the slowest link (issue 47): the config's side.

Selection (`--set select=tag:field-a`, all fields `select*`): which devices a run uses, by their traits
(protofl/traits.py) and profile; how many each round (`select_target`, invited `ceil(target * select_over)`, at
least `select_min`); and, with `select_fit = true`, who is left out of a round it cannot finish by the deadline
or would make it wait: estimated slower than `select_fit_ratio` times the median matching member (a straggler;
broker_server/core/selection.py estimates that from the device's declared link and compute profile).

    select = "tag:field-a"            one term: KEY:VALUE (or KEY=VALUE), KEY one of tag, profile, link, power
    select = "tag:field-a,link:lte"   terms of different keys must all match; of the same key, any one

`profile` matches the device part of a join's profile ("rpi4" of "rpi4+lte") or the whole of it; `link` the link
named in its traits or its profile; `power` "mains" or "battery".

Buffered asynchronous rounds (FedBuff, Nguyen et al., AISTATS 2022): `buffer_k = K` (0: synchronous rounds) makes
the server fold uploads as they arrive and publish a new global state (a new "round", the version counter) every K
uploads. An upload trained from version v arriving while the server is at version t has staleness s = t - v; it
is folded with weight `staleness_weight(s) = 1 / sqrt(1 + s)` (FedBuff's polynomial form, exponent 1/2) times its
usual weight, or dropped as stale when s > `staleness_bound`. The function is stated in docs/algorithms.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from protofl.errors import ConfigError
from protofl.names import NAME_RULE, is_valid_name

SELECT_KEYS = ("tag", "profile", "link", "power")

# The core config fields this module owns (defaults: every device, every round, synchronous). They travel only
# when set (protofl/config.py `_ONLY_WHEN_SET`), so a run that leaves them alone sends the config it always sent.
FIELDS: dict[str, object] = dict(
    select="",
    select_target=0,
    select_over=1.0,
    select_min=0,
    select_fit=False,
    select_compute_s=0.0,
    select_fit_ratio=2.0,
    buffer_k=0,
    staleness_bound=4,
)


@dataclass(frozen=True)
class Selector:
    """A parsed `select`: key -> the values any one of which matches (every key must match)."""

    terms: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.terms)

    def matches(self, tags: tuple[str, ...], profile: str, link: str, power: str) -> bool:
        device = profile.split("+", 1)[0]
        links = {link} | ({profile.split("+", 1)[1]} if "+" in profile else set())
        have = {
            "tag": set(tags),
            "profile": {device, profile},
            "link": links - {""},
            "power": {power} - {""},
        }
        return all(have[key] & set(values) for key, values in self.terms)


def parse_select(spec: str) -> Selector:
    """`select`'s value as a Selector; a ConfigError that says what is wrong and what is expected."""
    if not isinstance(spec, str):
        raise ConfigError(f"select must be a string such as 'tag:field-a', got {spec!r}")
    by_key: dict[str, list[str]] = {}
    for term in (t.strip() for t in spec.split(",")):
        if not term:
            continue
        key, sep, value = term.replace("=", ":", 1).partition(":")
        key, value = key.strip(), value.strip()
        if not sep or key not in SELECT_KEYS:
            raise ConfigError(f"select term '{term}': expected KEY:VALUE with KEY one of {', '.join(SELECT_KEYS)}")
        if not is_valid_name(value):
            raise ConfigError(f"select term '{term}': the value is not a valid name ({NAME_RULE})")
        by_key.setdefault(key, []).append(value)
    return Selector(tuple((k, tuple(sorted(set(v)))) for k, v in sorted(by_key.items())))


def staleness_weight(staleness: int) -> float:
    """FedBuff's weight of an upload `staleness` versions old: 1 / sqrt(1 + s) (1 for a fresh one)."""
    return 1.0 / math.sqrt(1.0 + staleness)


def check(values: dict[str, object]) -> list[str]:
    """The problems of these fields' values (empty: all fine)."""
    out: list[str] = []

    def integer(name: str, lo: int) -> None:
        v = values[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            out.append(f"{name} must be an integer >= {lo}, got {v!r}")

    try:
        parse_select(values["select"])  # type: ignore[arg-type]
    except ConfigError as exc:
        out.append(str(exc))
    for name in ("select_target", "select_min", "buffer_k"):
        integer(name, 0)
    integer("staleness_bound", 0)
    over = values["select_over"]
    if isinstance(over, bool) or not isinstance(over, (int, float)) or not 1.0 <= over <= 10.0:
        out.append(f"select_over must be a number in [1, 10] (the over-selection factor), got {over!r}")
    comp = values["select_compute_s"]
    if isinstance(comp, bool) or not isinstance(comp, (int, float)) or not 0.0 <= comp < math.inf:
        out.append(f"select_compute_s must be a number >= 0 (seconds on the reference machine), got {comp!r}")
    ratio = values["select_fit_ratio"]
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not (ratio == 0 or 1.0 <= ratio <= 100.0):
        out.append(
            f"select_fit_ratio must be 0 (off) or a number in [1, 100] (x the median member's time), got {ratio!r}"
        )
    if not isinstance(values["select_fit"], bool):
        out.append(f"select_fit must be true or false, got {values['select_fit']!r}")
    target, least = values["select_target"], values["select_min"]
    if not out and target and least > target:  # type: ignore[operator]
        out.append(f"select_min ({least}) must not exceed select_target ({target})")
    return out
