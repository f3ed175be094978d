"""`protofl-server status` for people: a header, the members, the last rounds.

Columns fold instead of being cut with an ellipsis, so piped output (80 columns) keeps every figure.
"""

from __future__ import annotations

import time
from datetime import datetime

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from broker_server.ops.privacy_ledger import describe_fleet
from broker_server.watch.snapshot import ACCURACY_KEYS, Member, Snapshot
from broker_server.watch.sources import Reading
from protofl import privacy
from protofl.humanize import accuracy_label, accuracy_legend, human_bytes, human_duration

ROUNDS_SHOWN = 5
REFUSALS_SHOWN = 10  # members whose refusal the header names


def _ago(seconds: float) -> str:
    return human_duration(max(0.0, seconds))


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}"


def _counts(values: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(values.items())) or "none"


def header(reading: Reading, now: float) -> list[str]:
    s = reading.snapshot
    state = f"{s.state}, server {reading.server}" if reading.server else s.state
    where = f"round {s.round}/{s.rounds}"
    if s.phase:
        where += f", phase {s.phase}"
    if s.deadline is not None and s.state == "running":
        left = s.deadline - now
        where += f", deadline in {_ago(left)}" if left > 0 else f", deadline passed {_ago(-left)} ago"
    members = ", ".join(
        f"{n} {state}" for state in ("online", "offline", "left", "not joined") if (n := s.count(state))
    )
    lines = [
        f"federation '{s.fed}' ({s.preset}): {state}, {where}",
        f"members: {len(s.members)} ({members or 'none yet'}); quorum {s.quorum}"
        if s.members
        else f"members: none yet; waiting for {s.quorum}",
        f"bytes so far: up {human_bytes(s.uplink_bytes)}, down {human_bytes(s.downlink_bytes)}; uploads accepted "
        f"{sum(s.accepted.values())}; dropped: {_counts(s.dropped)}; clipped: {_counts(s.clipped)}",
        f"broker restarts: {s.broker_restarts}; broker drops: {s.broker_dropped} (re-send requests "
        f"{s.resend_requests}); as of {datetime.fromtimestamp(s.updated):%H:%M:%S} "
        f"({_ago(now - s.updated)} ago) from {reading.source}",
    ]
    if s.privacy is not None:
        lines.append(privacy.describe(s.privacy))
    if s.fleet_privacy is not None:
        lines.append(describe_fleet(s.fleet_privacy))
    lines += [f"  dropped: {d}" for d in s.last_drops]
    if s.refusals:  # why a federation may wait at 0 members: its devices cannot take part (issue 55)
        lines.append(f"refused by {len(s.refusals)} member(s):")
        lines += [f"  refused: {r.member} ({r.times}x): {r.reason}" for r in s.refusals[:REFUSALS_SHOWN]]
        if len(s.refusals) > REFUSALS_SHOWN:
            lines.append(f"  ... and {len(s.refusals) - REFUSALS_SHOWN} more (state_dir/status.json has them all)")
    found = s.last_accuracies()
    if found is not None:
        lines.insert(
            3,
            f"accuracy (round {found[0]}): "
            + ", ".join(f"{accuracy_label(k)} {100 * v:.1f} %" for k, v in found[1].items()),
        )
    if s.learning is not None:  # protofl/learning.py: flat accuracies or a collapsed model
        lines.insert(4 if found is not None else 3, f"WARNING: the federation is {s.learning}")
    return lines


def _last_upload(m: Member, now: float) -> str:
    u = m.last_upload
    if u is None:
        return "-"
    return f"round {u.round} {u.phase} {u.kind}, {human_bytes(u.bytes)} {u.encoding}, {_ago(now - u.at)} ago"


def members_table(s: Snapshot, now: float) -> Table:
    t = Table(title="members", title_justify="left", expand=False)
    # "skipped": files of a device's data its loader could not read (its last metrics said), shown where any did
    skipped = any(m.skipped_files for m in s.members)
    cols = ("device", "state", "arch", "profile", "uploads", *(("skipped",) if skipped else ()), "last upload")
    for col in cols:
        t.add_column(col, overflow="fold", justify="right" if col in ("uploads", "skipped") else "left")
    for m in s.members:
        state = m.state
        if m.state == "offline" and m.grace_ends is not None:
            state += f" (keeps its place {_ago(m.grace_ends - now)})"
        profile = f"{m.profile or '-'} ({m.traits})" if m.traits else m.profile or "-"
        counts = (str(m.uploads), *((str(m.skipped_files),) if skipped else ()))
        t.add_row(m.id, state, m.arch or "-", profile, *counts, _last_upload(m, now))
    return t


def rounds_table(s: Snapshot) -> Table:
    t = Table(title=f"last {min(ROUNDS_SHOWN, len(s.history))} rounds", title_justify="left")
    for col in (
        "round",
        "devices",
        "closed by",
        *(accuracy_label(k) + " %" for k in ACCURACY_KEYS),
        "up",
        "down",
        "length",
    ):
        t.add_column(col, overflow="fold", justify="left" if col == "closed by" else "right")
    for r in s.history[-ROUNDS_SHOWN:]:
        t.add_row(
            str(r.round),
            f"{r.clients} (+{r.left_out} left out)" if r.left_out else str(r.clients),
            r.closed_by,
            *(_pct(getattr(r, k)) for k in ACCURACY_KEYS),
            human_bytes(r.uplink_bytes),
            human_bytes(r.downlink_bytes),
            human_duration(r.duration_s),
        )
    shown = [k for k in ACCURACY_KEYS if any(getattr(r, k) is not None for r in s.history[-ROUNDS_SHOWN:])]
    if shown:  # what the accuracy columns measure: "local" is not the federation's accuracy
        t.caption, t.caption_justify = accuracy_legend(shown), "left"
    return t


def status_view(reading: Reading, now: float | None = None) -> RenderableType:
    now = time.time() if now is None else now
    parts: list[RenderableType] = [Text(line) for line in header(reading, now)]
    if reading.snapshot.members:
        parts.append(members_table(reading.snapshot, now))
    if reading.snapshot.history:
        parts.append(rounds_table(reading.snapshot))
    return Group(*parts)
