"""Which members take part in a round (issue 47): the run's selection, with no I/O (numpy only).

A run's config says which devices it uses and how many each round (protofl/participation.py: `select`,
`select_target`, `select_over`, `select_min`, `select_fit`, `select_compute_s`). When a round opens, `choose`:

1. takes the members whose traits and profile match `select` (all, where it is empty);
2. with `select_fit`, leaves out each member that cannot finish the round by its deadline: its estimated time
   `rtt + round message bytes / downlink + its last upload's bytes / uplink + compute`, with
   `compute = select_compute_s x n_samples / the pool's median n_samples / compute_factor` (training grows with
   the samples a device holds: `select_compute_s` is the reference machine's time for the median member's data),
   from what its join reports - its sample count and the link and device profiles it names (profiles/), nothing
   a simulator knows -, against `round_timeout` (in the profiles' time: a simulation's links run `time_scale`
   times faster than the deadline it is given); and each member estimated slower than `select_fit_ratio`
   (default 2; 0: off) times a typical member (a straggler: a round lasts as long as its slowest member, so
   cutting the tail bounds a round at that multiple of a typical member's, whatever deadline the run was given).
   A typical member's time is the pool's median of the members' estimates at the median sample count (each
   member's link and device with typical data), so the bar does not move with which devices hold more data.
   A member whose profile names no link the server knows is kept (nothing to estimate from);
3. where fewer than `select_min` are left, takes back the fastest of those left out by (2) until there are;
4. with `select_target` T > 0, draws ceil(T * select_over) of them (over-selection), at random but determined by
   the run's seed and the round (a replayed journal draws the same: crash-exactness); the round's phases then
   close once T have sent everything (or every one invited has, or at the deadline).

Every member not chosen has a reason (the round record's `left_out`); the round machine tells it, on its own
`down/` topic, when to come back (`protofl.wire.Pace`) and leaves it out of the round message's participants.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from protofl.config import FederationConfig
from protofl.errors import ConfigError
from protofl.humanize import human_bytes
from protofl.participation import Selector, parse_select
from protofl.profiles import DeviceProfile, LinkProfile, parse_pair
from protofl.wire import Join

_SALT = 47  # the draw's stream, apart from every other seeded stream of the run


@dataclass(frozen=True)
class Choice:
    """A round's members: those chosen (sorted), and why each other one is not."""

    chosen: tuple[str, ...]
    left_out: dict[str, str]


class Selection:
    def __init__(self, cfg: FederationConfig, time_scale: float = 1.0) -> None:
        self.cfg = cfg
        self.selector: Selector = parse_select(cfg.select)
        self.active = bool(self.selector) or cfg.select_target > 0 or cfg.select_fit
        self.time_scale = time_scale  # how much faster the links run than the deadline the server is given
        self._profiles: dict[str, tuple[DeviceProfile | None, LinkProfile | None]] = {}

    @property
    def target(self) -> int:
        return self.cfg.select_target

    def _profile(self, spec: str) -> tuple[DeviceProfile | None, LinkProfile | None]:
        if spec not in self._profiles:
            try:
                self._profiles[spec] = parse_pair(spec) if spec else (None, None)
            except ConfigError:  # a profile file on the device, or a name this server lacks
                self._profiles[spec] = (None, None)
        return self._profiles[spec]

    def matches(self, join: Join) -> bool:
        t = join.traits
        if t is None:
            return self.selector.matches((), join.profile, "", "")
        return self.selector.matches(t.tags, join.profile, t.link, t.power)

    def estimate(self, join: Join, down_bytes: int, up_bytes: int, share: float = 1.0) -> float | None:
        """Seconds (the profiles' time) this member needs for the round, or None where its link is unknown;
        `share`: its training's size against `select_compute_s`'s (its sample count over the pool's median)."""
        device, link = self._profile(join.profile)
        if link is None and join.traits is not None and join.traits.link:
            link = self._profile(join.traits.link)[1]
        if link is None:
            return None
        t = link.rtt_ms / 1000.0
        t += down_bytes * 8 / (link.downlink_kbps * 1000.0) + up_bytes * 8 / (link.uplink_kbps * 1000.0)
        if device is not None and self.cfg.select_compute_s > 0:
            t += self.cfg.select_compute_s * share / device.compute_factor
        return t

    def choose(self, round_: int, members: Mapping[str, Join], down_bytes: int, up_bytes: Mapping[str, int]) -> Choice:
        cfg = self.cfg
        left_out: dict[str, str] = {}
        pool: list[str] = []
        for c in sorted(members):
            if self.selector and not self.matches(members[c]):
                left_out[c] = f"not selected by select={cfg.select}"
            else:
                pool.append(c)
        if cfg.select_fit:
            deadline = cfg.round_timeout * self.time_scale
            known = sorted(v for v in up_bytes.values() if v > 0)
            typical = known[len(known) // 2] if known else 0  # a member that uploaded nothing yet: the median's
            samples = sorted(max(0, members[c].n_samples) for c in pool)
            median_n = samples[len(samples) // 2] if samples else 0
            ests: dict[str, float | None] = {}
            refs: list[float] = []
            for c in pool:
                up = up_bytes.get(c) or typical
                share = max(0, members[c].n_samples) / median_n if median_n > 0 else 1.0
                ests[c] = self.estimate(members[c], down_bytes, up, share)
                ref = self.estimate(members[c], down_bytes, up)  # its link and device with the median member's data
                if ref is not None:
                    refs.append(ref)
            # A typical member: the pool's median of each member's estimate at the median sample count (the upper
            # median: an even pool's faster half waits), so the bar does not move with how the data is spread.
            median = sorted(refs)[len(refs) // 2] if refs else 0.0
            bar = min(deadline, cfg.select_fit_ratio * median) if cfg.select_fit_ratio > 0 and median > 0 else deadline
            slow = sorted((e, c) for c, e in ests.items() if e is not None and e > bar)
            back = max(0, cfg.select_min - (len(pool) - len(slow)))  # the fastest of the slow, up to select_min
            for est, c in slow[back:]:
                join = members[c]
                what = (
                    f"~{est:.0f} s on {join.profile or 'its link'} ({join.n_samples} samples) for "
                    f"{human_bytes(down_bytes)} down and "
                    f"{human_bytes(up_bytes.get(c) or typical)} up"
                )
                left_out[c] = (
                    f"cannot finish by the deadline: {what}, deadline {deadline:.0f} s"
                    if est > deadline
                    else f"a straggler: {what}, over {cfg.select_fit_ratio:g} x the median member's ~{median:.1f} s"
                )
            out = {c for _, c in slow[back:]}
            pool = [c for c in pool if c not in out]
        if cfg.select_target > 0:
            invite = min(len(pool), max(cfg.select_min, math.ceil(cfg.select_target * cfg.select_over)))
            if invite < len(pool):
                order = np.random.default_rng([cfg.seed, round_, _SALT]).permutation(len(pool))
                drawn = {pool[i] for i in order[:invite].tolist()}
                for c in pool:
                    if c not in drawn:
                        left_out[c] = (
                            f"not drawn this round (target {cfg.select_target}, over-selection {cfg.select_over:g})"
                        )
                pool = [c for c in pool if c in drawn]
        return Choice(tuple(pool), left_out)
