"""The per-device, per-round timeline of a simulation over shaped links, in simulated seconds.

For device d in round r (times from the round's opening at the server):

    downlink_s = (round message reached d - round opened) x time_scale        measured, through d's link
    compute_s  = d's CPU time for the round / compute_factor                   emulated (edge_agent.core.emulation)
    upload_s   = (upload reached the broker - upload went) x time_scale        measured, through d's link
                 (from when it went: not the time the simulator held it for other devices' earlier uploads,
                 edge_agent/core/emulation.py `ReleaseOrder`, this machine's wait, reported in `overrun_s`)
    done_s     = downlink_s + compute_s + upload_s

With `nominal` (simulate `--sample-cost`: compute from the profiles, edge_agent/core/emulation.py) the link
times come from the profiles too: `downlink_s = RTT/2 + round message bytes / downlink rate`,
`upload_s = RTT/2 + upload bytes / uplink rate`, so that a run's simulated times do not move with this machine's
load (the bound beside which LINKS.md measured them: within 10 %).

`done_s` composes measured link times with the emulated compute, so it stays honest where this
machine could not keep up with the time scale (`overrun_s` > 0: the upload left later in real time
than the emulation asked). On that composed clock each upload arrives at

    arrive = max(round opened + downlink_s, the device's previous release) + compute_s + upload_s

(a device trains one version at a time: an asynchronous device still busy with an older version starts the
next one when it released that one's upload). A round's simulated length `round_s` is, from its opening:

- closed once its uploads were in (quorum, FedBuff's buffer of K, a selection's target): the latest composed
  arrival among the uploads it folded, stale ones (trained from an older version) included;
- closed at its deadline: the deadline, unless every device expected in it (the chosen, with a selection;
  else every client) arrived within it on the composed clock - then it closed at the deadline only because
  this machine released an upload late, and its length is the latest of those arrivals;
- where no upload it folded has a composed time: its real length x time_scale.

Which uploads a version folded was decided in real time. With thread agents (the benchmarks' and tests'
simulations) the uploads leave in the order of their emulated release times on a virtual clock whatever this
machine's load (`ReleaseOrder`): the lag this machine builds up training the devices one at a time is dropped at
each release, so that choice is the one a machine that keeps up would make, within a version and across versions.
It is approximate where link times move with the load (measured links) or the server spends real time between
versions (its evaluation): the virtual clock runs at the real rate between releases.
`wall_round_s` (real open-to-close x time_scale) is
reported beside it. Time between rounds (the simulator's own evaluation) is not counted. numpy only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from broker_server.core.rounds import RoundRecord
from broker_server.simulation.links import Arrival
from protofl.profiles import DeviceClass
from protofl.wire import Metrics


def device_rows(
    rec: RoundRecord,
    clients: Sequence[str],
    devices: Sequence[DeviceClass],
    arrivals: Sequence[Arrival],
    metrics: Mapping[str, Metrics],
    scale: float,
    deadline_s: float,
    waited: Mapping[tuple[str, float], float] | None = None,
    nominal: bool = False,
    went: Mapping[tuple[str, float], float] | None = None,
) -> list[dict[str, Any]]:
    """`waited`: (device, release time) -> seconds the simulator held that upload past its release time; `went`:
    (device, release time) -> when it went (real; thread agents' virtual clock: the release time is virtual);
    `nominal`: link times from the profiles (the module's docstring), not measured."""
    waited, went = waited or {}, went or {}
    rows = []
    for cid, dev in zip(clients, devices, strict=True):
        mine = [a for a in arrivals if a.sender == cid and a.round == rec.round]
        # The first of each (phase, kind) counts; later copies are re-sends after a reconnect (dropped as
        # duplicates by the server) and are reported apart.
        first: dict[tuple[str, str], Arrival] = {}
        for a in sorted(mine, key=lambda a: a.t):
            first.setdefault((a.phase, a.kind), a)
        ups = list(first.values())
        extra = dict(metrics[cid].extra) if cid in metrics else {}
        last = max((a.t for a in ups), default=None)
        row: dict[str, Any] = {
            "round": rec.round,
            "client": cid,
            "class": dev.name,
            "device": dev.device.name,
            "link": dev.link.name,
            "made_it": cid in rec.clients,
            "uplink_bytes": sum(a.nbytes for a in ups),
            "resent_bytes": sum(a.nbytes for a in mine) - sum(a.nbytes for a in ups),
            "dt": ups[0].dt if ups else None,
            "k": next((a.k for a in ups if a.k is not None), None),
            "budget_bytes": int(extra["upload_budget"]) if "upload_budget" in extra else None,
            "fits": bool(extra["upload_fits"]) if "upload_fits" in extra else None,
            "downlink_s": None,
            "compute_s": extra.get("compute_s"),
            "compute_cpu_s": extra.get("compute_cpu_s"),
            "upload_s": None,
            "done_s": None,
            "wall_done_s": None,
            "overrun_s": extra["overrun_s"] * scale if "overrun_s" in extra else None,
        }
        if "recv_t" in extra:
            row["downlink_s"] = max(0.0, (extra["recv_t"] - rec.started) * scale)
            if nominal and "recv_bytes" in extra:
                row["downlink_s"] = dev.link.rtt_ms / 2000 + extra["recv_bytes"] / dev.link.downlink_bytes_per_s
        if last is not None:
            row["wall_done_s"] = (last - rec.started) * scale
            if "release_t" in extra:
                held = waited.get((cid, extra["release_t"]), 0.0)
                left = went.get((cid, extra["release_t"]), extra["release_t"] + held)  # when it went, real
                row["upload_s"] = max(0.0, (last - left) * scale)
                if nominal:
                    row["upload_s"] = dev.link.rtt_ms / 2000 + row["uplink_bytes"] / dev.link.uplink_bytes_per_s
                if held and row["overrun_s"] is not None:
                    row["overrun_s"] += held * scale
        if None not in (row["downlink_s"], row["compute_s"], row["upload_s"]):
            row["done_s"] = row["downlink_s"] + row["compute_s"] + row["upload_s"]
        # In time by the composed clock; `made_it` is the server's word (real time, so an overrun of
        # this machine can make a device miss that the composed clock says was in time).
        row["in_time"] = row["done_s"] is not None and row["done_s"] <= deadline_s
        rows.append(row)
    return rows


def round_summary(
    rec: RoundRecord,
    rows: Sequence[dict[str, Any]],
    scale: float,
    deadline_s: float,
    opened: float = 0.0,
    arrive: Mapping[tuple[str, int], float] | None = None,
) -> dict[str, Any]:
    """The round's length on the composed clock (the module's docstring): `opened` its simulated opening,
    `arrive` the composed arrival of each (device, version trained from) so far."""
    arrive = arrive or {}
    folded = []
    for key in rec.clients:
        cid, _, trained = key.partition("@")  # a stale upload: "device@the version it trained from"
        folded.append(arrive.get((cid, int(trained) if trained else rec.round)))
    expected = rec.selected or [r["client"] for r in rows]
    fresh = [arrive.get((c, rec.round)) for c in expected]
    if rec.closed_by == "deadline":
        in_time = fresh and all(a is not None and a - opened <= deadline_s for a in fresh)
        round_s = max(a for a in fresh if a is not None) - opened if in_time else deadline_s
    elif any(a is not None for a in folded):  # an upload without timings (its metrics lost) does not count
        round_s = max(0.0, max(a for a in folded if a is not None) - opened)
    else:
        round_s = (rec.ended - rec.started) * scale
    return {
        "round": rec.round,
        "round_s": round_s,
        "wall_round_s": (rec.ended - rec.started) * scale,
        "closed_by": rec.closed_by,
        "missed": sorted(r["client"] for r in rows if not r["made_it"]),
    }


def timeline(
    records: Sequence[RoundRecord],
    clients: Sequence[str],
    devices: Sequence[DeviceClass],
    arrivals: Sequence[Arrival],
    metrics: Mapping[int, Mapping[str, Metrics]],
    scale: float,
    deadline_s: float,
    waited: Mapping[tuple[str, float], float] | None = None,
    nominal: bool = False,
    went: Mapping[tuple[str, float], float] | None = None,
) -> dict[str, Any]:
    """The report's `links` section: per-round lengths with the running simulated time, per-device rows."""
    rounds, devices_out, t = [], [], 0.0
    released: dict[str, float] = {}  # each device's last release on the composed clock (busy until then)
    arrive: dict[tuple[str, int], float] = {}
    for rec in records:
        rows = device_rows(
            rec, clients, devices, arrivals, metrics.get(rec.round, {}), scale, deadline_s, waited, nominal, went
        )
        for row in rows:
            if row["done_s"] is not None:
                cid = row["client"]
                released[cid] = max(t + row["downlink_s"], released.get(cid, 0.0)) + row["compute_s"]
                arrive[(cid, rec.round)] = released[cid] + row["upload_s"]
        summary = round_summary(rec, rows, scale, deadline_s, t, arrive)
        t += summary["round_s"]
        summary["sim_time_s"] = t
        rounds.append(summary)
        devices_out.extend(rows)
    return {"rounds": rounds, "devices": devices_out}


class LinkReport:
    """What a simulation over shaped links adds to its report (the `links` section)."""

    def __init__(
        self,
        devices: Sequence[DeviceClass],
        clients: Sequence[str],
        links: Any,
        watcher: Any,
        *,
        time_scale: float,
        deadline_s: float,
        adaptive: bool,
        upload_share: float,
        nominal: bool = False,
    ) -> None:
        self.devices, self.clients, self.links, self.watcher = list(devices), list(clients), links, watcher
        self.nominal = nominal  # link times from the profiles (simulate --sample-cost), not measured
        self.time_scale, self.deadline_s = time_scale, deadline_s
        self.adaptive, self.upload_share = adaptive, upload_share
        self._grace_end: float | None = None
        self.order: Any = (
            None  # thread agents' ReleaseOrder (edge_agent/core/emulation.py): its holds are this machine's
        )

    def timings_in(self, metrics: Mapping[int, Mapping[str, Metrics]]) -> bool:
        """Whether every device has reported its timings (metrics) for every round so far."""
        rounds = [r for r in metrics if r >= 1]
        return bool(rounds) and all(
            cid in metrics.get(r, {}) for r in range(1, max(rounds) + 1) for cid in self.clients
        )

    def grace_over(self, now: float, grace_s: float = 30.0) -> bool:
        """After the federation finished, wait at most `grace_s` real seconds for late timings."""
        if self._grace_end is None:
            self._grace_end = now + grace_s
        return now >= self._grace_end

    def sim_time(self, records: Sequence[RoundRecord], metrics: Mapping[int, Mapping[str, Metrics]]) -> float:
        """Simulated time at the end of the last of `records` (the rounds so far, in order): the composed
        clock of the `links` section, the one figure the progress bar, the rows and the report all show."""
        rounds = self._timeline(records, metrics)["rounds"]
        return float(rounds[-1]["sim_time_s"]) if rounds else 0.0

    def to_json(self, records: Sequence[RoundRecord], metrics: Mapping[int, Mapping[str, Metrics]]) -> dict[str, Any]:
        classes: dict[str, dict[str, Any]] = {}
        for d in self.devices:
            c = classes.setdefault(
                d.name,
                {
                    "class": d.name,
                    "count": 0,
                    "compute_factor": d.device.compute_factor,
                    "memory_mb": d.device.memory_mb,
                    "uplink_kbps": d.link.uplink_kbps,
                    "downlink_kbps": d.link.downlink_kbps,
                    "rtt_ms": d.link.rtt_ms,
                    "jitter_ms": d.link.jitter_ms,
                },
            )
            c["count"] += 1
        out = {
            "time_scale": self.time_scale,
            "deadline_s": self.deadline_s,
            "adaptive": self.adaptive,
            "upload_share": self.upload_share,
            "nominal_links": self.nominal,
            "classes": list(classes.values()),
            "clients": {cid: d.name for cid, d in zip(self.clients, self.devices, strict=True)},
            "proxies": self.links.stats(),
        }
        out.update(self._timeline(records, metrics))
        out["release_order"] = (
            None if self.order is None else {"held": len(self.order.waited), "forced": self.order.forced}
        )
        return out

    def _timeline(self, records: Sequence[RoundRecord], metrics: Mapping[int, Mapping[str, Metrics]]) -> dict[str, Any]:
        waited = {} if self.order is None else dict(self.order.waited)
        went = {} if self.order is None else dict(self.order.went)
        arrivals = self.watcher.arrivals
        return timeline(
            records,
            self.clients,
            self.devices,
            arrivals,
            metrics,
            self.time_scale,
            self.deadline_s,
            waited,
            self.nominal,
            went,
        )
