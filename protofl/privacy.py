"""Differential privacy of what a device uploads (issue 46): device-side clipping, calibrated Gaussian noise,
and the accountant that says what a run spends (numpy; `dp-accounting` only where epsilon is computed).

The mechanism, per round and per device (local DP: the device adds all of the noise itself):

- every prototype row the device sends (its own classes' and the public set's, in every phase of the round,
  after the techniques' encodings: on the values that travel, e.g. a support mask's values) is clipped to L2
  norm `dp_clip` (C);
- a device sends at most R rows a round (`rows_per_round`), so two of its uploads, whatever its data, differ
  by at most 2 C sqrt(R) in L2 (the sensitivity `sensitivity`: replace-one at the level of the device, every
  row anywhere in the C-ball);
- Gaussian noise N(0, (z * sensitivity)^2) is added to every value sent, z the noise multiplier (`dp_noise`,
  or calibrated from the run's budget `dp_epsilon` at `dp_delta` over `rounds` rounds);
- counts travel as 1 for every class sent (the server's weighted mean becomes the plain mean over senders),
  and the upload's n_samples as 1.

Distributed (`dp_mode=distributed`, only with secure aggregation: protofl/secagg.py, broker_server/core/secagg_run.py):
the same, but each device adds N(0, (z * sensitivity)^2 / min_clients) (`DpSettings.device_std`), to the rows of
the classes it sends and to the zero rows of those it lacks (`absent_noise`); the server sees only the sum of at
least min_clients devices' tables, whose every class carries the whole variance.

What stays revealed (docs/privacy.md): which classes a device sends (its label set: a class with at least one
sample), that it took part in a round, its join message's sample count, and its metrics messages (accuracies
on its own split). The accountant composes one Gaussian mechanism of multiplier z per round (the RDP accountant
of `dp-accounting`): a device that takes part in every round spends what it reports; one that skips rounds
spends less. No sampling amplification: the server knows who took part.

The noise comes from the operating system's entropy, never from the federation's seed, which the server knows:
a seeded noise could be subtracted. A run with DP is therefore not reproducible bit for bit.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from protofl.errors import ConfigError

if TYPE_CHECKING:
    from protofl.config import FederationConfig
    from protofl.plan import RoundPlan
    from protofl.technique import PlanDraft

# "local": each device adds all of the noise; "distributed": under secure aggregation (the server sees only the sum
# of at least min_clients devices' tables), each device adds a 1/min_clients share of the variance.
MODES = ("local", "distributed")
NOT_YET: dict[str, str] = {}


@dataclass(frozen=True)
class DpSettings:
    """A federation's DP mechanism, resolved: what a device applies and what the server accounts."""

    epsilon: float  # the run's budget
    delta: float
    clip: float  # C: every row's L2 bound
    noise: float  # z: the noise std is z * sensitivity
    rows: int  # R: rows a device may send in one round
    mode: str = "local"

    @property
    def sensitivity(self) -> float:
        """L2 distance between two of a device's round releases, whatever its data: 2 C sqrt(R)."""
        return 2.0 * self.clip * math.sqrt(self.rows)

    @property
    def std(self) -> float:
        """The noise standard deviation each value gets (local DP: all of it, on each device)."""
        return self.noise * self.sensitivity

    def device_std(self, min_clients: int) -> float:
        """The noise std one device adds: all of it (local), or its share of a sum of at least `min_clients`
        devices' (distributed, under secure aggregation: that sum carries the whole variance)."""
        return self.std if self.mode == "local" else self.share_std(min_clients)

    def share_std(self, devices: int) -> float:
        """A device's share of the noise when `devices` (at least) add theirs to one sum: variance / devices."""
        if devices < 1:
            raise ValueError(f"devices must be >= 1, got {devices}")
        return self.std / math.sqrt(devices)

    def spent(self, rounds: int) -> float:
        """Epsilon at `delta` after `rounds` rounds (0 before the first)."""
        return epsilon_after(self.noise, rounds, self.delta)

    def as_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "epsilon_budget": self.epsilon,
            "delta": self.delta,
            "clip": self.clip,
            "noise_multiplier": self.noise,
            "rows_per_round": self.rows,
            "noise_std": self.std,
        }


def rows_per_round(draft: PlanDraft | RoundPlan) -> int:
    """R: the most prototype rows a device sends in one round: per phase that takes prototypes, one per class
    (its own), plus one per public class where the phase carries the public set's."""
    from protofl.technique import Upload  # (protofl.technique imports the wire; keep this module light)

    rows = 0
    for phase in draft.phases:
        if Upload.PROTOS in draft.uploads.get(phase, ()):
            rows += draft.num_classes + (len(draft.public_classes) if draft.public_phase is phase else 0)
    return max(rows, 1)


def check(cfg: FederationConfig, draft: PlanDraft) -> None:
    """Refuse what DP does not cover, with what to change (called when a config is built)."""
    if cfg.dp_epsilon is None:
        if cfg.dp_noise is not None:
            raise ConfigError("dp_noise is set but dp_epsilon is not: set the run's budget --set dp_epsilon=... too")
        return
    if cfg.dp_mode in NOT_YET:
        raise ConfigError(f"dp_mode '{cfg.dp_mode}' {NOT_YET[cfg.dp_mode]}; use dp_mode=local")
    if cfg.dp_mode == "distributed" and not (cfg.secagg and cfg.min_clients >= 2):
        raise ConfigError(
            "dp_mode=distributed: each device adds a 1/min_clients share of the noise, which is enough only where "
            "the server sees nothing but the sum of at least min_clients devices: it needs secure aggregation "
            f"(--set secagg=true) and min_clients >= 2 (got secagg={cfg.secagg}, min_clients={cfg.min_clients})"
        )
    sends_vectors = any(k.value == "adapter" for kinds in draft.uploads.values() for k in kinds)
    if sends_vectors:
        raise ConfigError(
            "differential privacy covers prototype uploads only; this federation also uploads parameter vectors "
            f"or statistics (federate={cfg.federate!r}, techniques {list(cfg.techniques)}), which would travel "
            "without noise: use a prototype-only federation (federate=none; for the protofl preset --set ridge=false)"
        )


def check_secagg(cfg: FederationConfig, draft: PlanDraft) -> None:
    """Refuse a federation that secure aggregation (`secagg`, protofl/secagg.py) cannot cover, with the reason."""
    if not cfg.secagg:
        return
    from protofl.technique import Phase, Upload

    uploads = {p: tuple(k) for p, k in draft.uploads.items() if k}
    masked = ({Phase.TRAIN: (Upload.PROTOS,)}, {Phase.TRAIN: (Upload.ADAPTER,)})  # prototype tables, or one vector
    if uploads not in masked or draft.public_phase is not None:
        raise ConfigError(
            "secagg: secure aggregation covers the per-class prototype sums and counts of a prototype-only "
            "federation (tinyproto, fedproto), or the weighted sum of one dense parameter vector (fedavg, the "
            f"model or the adapter); this one (techniques {list(cfg.techniques)}, federate="
            f"{cfg.federate!r}) uploads {sorted({k.value for ks in uploads.values() for k in ks})} in phases "
            f"{[p.value for p in uploads]}{', with public-set prototypes' if draft.public_phase else ''}: "
            "adapters beside prototypes and sparse top-K adapter updates are not masked yet (docs/privacy.md)"
        )
    if cfg.buffer_k:
        raise ConfigError(
            "secagg: buffered asynchronous rounds (buffer_k) fold uploads one by one as they come; secure "
            "aggregation unmasks one sum per phase: leave buffer_k unset"
        )


def resolve(cfg: FederationConfig, draft: PlanDraft | RoundPlan) -> DpSettings | None:
    """The federation's DP mechanism (None: DP off). Calibrates z where `dp_noise` is not set (needs
    dp-accounting), so that `rounds` rounds spend exactly `dp_epsilon`."""
    if cfg.dp_epsilon is None:
        return None
    noise = cfg.dp_noise
    if noise is None:
        noise = calibrate(cfg.dp_epsilon, cfg.dp_delta, cfg.rounds)
    return DpSettings(
        epsilon=float(cfg.dp_epsilon),
        delta=float(cfg.dp_delta),
        clip=float(cfg.dp_clip),
        noise=float(noise),
        rows=rows_per_round(draft),
        mode=cfg.dp_mode,
    )


# -- the device's half ---------------------------------------------------------------------------------------
def clip_rows(rows: np.ndarray, clip: float) -> np.ndarray:
    """Each row scaled down to L2 norm <= `clip` (float64; a row inside the ball is unchanged)."""
    rows = np.asarray(rows, dtype=np.float64)
    norms = np.linalg.norm(rows, axis=-1, keepdims=True)
    return rows * np.minimum(1.0, clip / np.maximum(norms, 1e-300))


def privatize(
    protos: Mapping[int, np.ndarray],
    counts: Mapping[int, int] | None,
    std: float,
    clip: float,
    rng: np.random.Generator,
) -> tuple[dict[int, np.ndarray], dict[int, int] | None]:
    """One table on its way to the wire: every row clipped to `clip`, then N(0, std^2) added to every value;
    counts become 1 (the classes sent stay as they are: see the module's docstring)."""
    out: dict[int, np.ndarray] = {}
    for c, row in protos.items():
        clipped = clip_rows(np.asarray(row)[None, :], clip)[0]
        out[c] = (clipped + rng.normal(0.0, std, size=clipped.shape)).astype(np.float32)
    return out, None if counts is None else {c: 1 for c in counts}


def absent_noise(num_classes: int, width: int, present: np.ndarray, std: float, rng: np.random.Generator) -> np.ndarray:
    """Distributed DP under secure aggregation: a device's noise share for the classes it lacks (zeros in the rows
    of the classes it sends, which `privatize` noised already). Its masked table carries a zero row for each class
    it lacks (so that the server cannot tell its label set); that row takes a share of the noise too, so that every
    class's unmasked sum carries the shares of every device that took part (at least min_clients: the whole
    variance), not only of the devices that hold the class. The row's weight stays 0: the class's mean is still
    over the devices that hold it."""
    out = rng.normal(0.0, std, size=(num_classes, width))
    out[np.asarray(present, dtype=np.int64)] = 0.0
    return out


def device_rng() -> np.random.Generator:
    """The noise's generator: seeded from the OS's entropy (a seed the server knows would undo the noise)."""
    return np.random.default_rng()


# -- the accountant -------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4096)
def epsilon_after(noise: float, rounds: int, delta: float) -> float:
    """Epsilon at `delta` of `rounds` compositions of the Gaussian mechanism of multiplier `noise` (dp-accounting's
    RDP accountant; the exact figure is a little lower: tests/protofl/test_privacy.py)."""
    if rounds <= 0:
        return 0.0
    import dp_accounting
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    acc = rdp.RdpAccountant()
    acc.compose(dp_accounting.GaussianDpEvent(noise), rounds)
    return float(acc.get_epsilon(delta))


@functools.lru_cache(maxsize=256)
def calibrate(epsilon: float, delta: float, rounds: int) -> float:
    """The smallest noise multiplier whose `rounds` rounds spend at most `epsilon` at `delta`."""
    import dp_accounting
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    z = dp_accounting.calibrate_dp_mechanism(
        rdp.RdpAccountant,
        lambda s: dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(s), rounds),
        epsilon,
        delta,
        dp_accounting.LowerEndpointAndGuess(1e-3, 1.0),
        tol=1e-6,
    )
    return float(z)


def ledger(dp: DpSettings, rounds: int) -> dict[str, Any]:
    """What a run reports after `rounds` closed rounds: the settings, one round's epsilon, the cumulative one."""
    return {
        **dp.as_dict(),
        "epsilon_per_round": dp.spent(1),
        "epsilon_spent": dp.spent(rounds),
        "rounds_accounted": rounds,
    }


def describe(p: Mapping[str, Any]) -> str:
    """A `ledger` in one line (status, the simulation's summary, the report)."""
    return (
        f"privacy ({p['mode']} DP): epsilon {p['epsilon_spent']:.3g} of {p['epsilon_budget']:g} spent after "
        f"{p['rounds_accounted']} round(s) ({p['epsilon_per_round']:.3g} a round alone), delta {p['delta']:g}, "
        f"clip {p['clip']:g}, noise multiplier {p['noise_multiplier']:.3g}"
    )


def stop_reason(dp: DpSettings | None, closed: int) -> str | None:
    """Why the round after `closed` closed rounds may not open (its release would overspend the budget), or None."""
    if dp is None:
        return None
    after = dp.spent(closed + 1)
    if after <= dp.epsilon * (1 + 1e-9):
        return None
    return (
        f"privacy budget spent: epsilon {dp.spent(closed):.3g} after {closed} round(s); round {closed + 1} would "
        f"make it {after:.3g} > dp_epsilon {dp.epsilon:g} (delta {dp.delta:g}): the run stops here"
    )


def check_numbers(cfg: FederationConfig) -> list[str]:
    """Problems with the DP fields' values (ConfigError's text)."""
    problems = []

    def number(name: str, low: float, high: float | None = None, none: bool = False) -> None:
        v = getattr(cfg, name)
        if v is None and none:
            return
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > low
        if not ok or (high is not None and v >= high):
            bound = f"in ({low:g}, {high:g})" if high is not None else f"> {low:g}"
            problems.append(f"config '{name}' must be a number {bound}{' or unset' if none else ''}, got {v!r}")

    number("dp_epsilon", 0.0, none=True)
    number("dp_delta", 0.0, 1.0)
    number("dp_clip", 0.0)
    number("dp_noise", 0.0, none=True)
    if cfg.dp_mode not in MODES and cfg.dp_mode not in NOT_YET:
        problems.append(f"dp_mode must be one of {MODES}, got {cfg.dp_mode!r}")
    return problems
