"""Bandwidth-adaptive uploads: what a device sends so that its upload fits its link and the deadline.

The budget (docs/design.md, "Constrained links"): a device may spend `share` of the time left before the
round's deadline on its upload, at its uplink rate,

    budget_bytes = uplink_bytes_per_s * share * (time to deadline - compute time - one round trip)

all in simulated (unscaled) seconds. Given the budget, the device steps down, richest first, until
everything it uploads this round fits:

    1. the config's wire dtype, then the lower precisions after it (f4 -> f2 -> q8), at the
       config's sparse K (prototypes, parameter vectors and sparse values together);
    2. with a sparse parameter upload, at the lowest precision, the largest K that fits (binary search
       on exact sizes).

Sizes are exact: the caller's `size_of(dt, k)` encodes the messages. Where nothing fits (FedAvg over
NB-IoT) the leanest encoding is sent anyway and the choice says it does not fit: the upload may
miss the deadline, and the report shows it. numpy-free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from protofl.config import DTYPE_CHOICES

LEVELS = DTYPE_CHOICES  # ("f4", "f2", "q8"): richest first
VALUE_BYTES = {"f4": 4, "f2": 2, "q8": 1}


@dataclass(frozen=True)
class UploadChoice:
    dt: str  # the wire dtype of every float array this round's uploads carry
    k: int | None  # APUD K (None without APUD)
    nbytes: int  # encoded bytes of this round's uploads at (dt, k)
    budget: int | None  # None: adaptive uploads off, the config's encoding
    fits: bool

    def as_extra(self) -> dict[str, float]:
        """For the metrics message's `extra` (floats only): what was chosen, and under which budget."""
        out = {
            "upload_bytes": float(self.nbytes),
            "upload_value_bytes": float(VALUE_BYTES[self.dt]),
            "upload_fits": float(self.fits),
        }
        if self.budget is not None:
            out["upload_budget"] = float(self.budget)
        if self.k is not None:
            out["upload_k"] = float(self.k)
        return out


def upload_budget(uplink_bytes_per_s: float, share: float, seconds_left: float) -> int:
    """Bytes the uplink carries in `share` of `seconds_left` (never negative)."""
    if not 0 < share <= 1:
        raise ValueError(f"upload share must be in (0, 1], got {share}")
    return max(0, int(uplink_bytes_per_s * share * seconds_left))


def leaner(a: str, b: str) -> str:
    """The lower precision of two wire dtypes."""
    return max(a, b, key=LEVELS.index)


def lower_levels(dt: str) -> tuple[str, ...]:
    """`dt` and the precisions below it."""
    return LEVELS[LEVELS.index(dt) :]


def choose_upload(
    size_of: Callable[[str, int | None], int | None], dt: str, k: int | None, budget: int | None
) -> UploadChoice:
    """The richest (dt, K) whose uploads fit `budget` bytes; see the module docstring.

    `size_of(dt, k)` is the encoded size of everything uploaded this round, or None where the values
    cannot travel at `dt` (f2 beyond +-65504)."""
    if budget is None:
        n = size_of(dt, k)
        return UploadChoice(dt, k, n if n is not None else 0, None, True)
    last: UploadChoice | None = None
    for level in lower_levels(dt):
        n = size_of(level, k)
        if n is None:
            continue
        last = UploadChoice(level, k, n, budget, n <= budget)
        if last.fits:
            return last
    assert last is not None, "q8 encodes any finite values"
    if k is None or k <= 1:
        return last
    lo, hi = 1, k  # the largest K in [1, k) whose size fits; size grows with K
    small = size_of(last.dt, 1)
    assert small is not None
    if small > budget:
        return UploadChoice(last.dt, 1, small, budget, False)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        n = size_of(last.dt, mid)
        if n is not None and n <= budget:
            lo = mid
        else:
            hi = mid - 1
    n = size_of(last.dt, lo)
    assert n is not None
    return UploadChoice(last.dt, lo, n, budget, True)
