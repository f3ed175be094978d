"""The Prometheus endpoint (`start --metrics-port`): the federation in Prometheus' conventions.

Two histograms are observed as things happen, on the service thread (prometheus_client's metrics are
thread-safe): each closed round's duration and each journal fsync. Everything else is read from the
latest snapshot when Prometheus scrapes (`SnapshotCollector`), on the HTTP server's thread, so a scrape
never touches the aggregator. Names, types and labels (docs/design.md, "Watching a federation"):

    protofl_federation_info{fed,preset}               gauge 1
    protofl_round / protofl_rounds_planned             gauge: the open (or last) round / --rounds
    protofl_rounds_completed_total                     counter
    protofl_phase{phase}                               gauge 1 for the current phase, 0 for the others
    protofl_phase_deadline_timestamp_seconds           gauge (absent while no phase is open)
    protofl_members{state}                             gauge: online, offline, left, not joined
    protofl_device_online{device}                      gauge 1/0 (devices are the federation's members)
    protofl_device_last_upload_timestamp_seconds{device}
    protofl_device_skipped_files{device}               gauge: files of the device's data its loader skipped
                                                       (unreadable), as its last metrics said
    protofl_uploads_accepted_total{kind}               counter (the federation's, restarts included)
    protofl_uploads_dropped_total{reason}              counter (this server process)
    protofl_uploads_clipped_total{kind}                counter
    protofl_dp_epsilon_spent / _budget / _per_round, protofl_dp_delta   gauge (with differential privacy only)
    protofl_uplink_bytes_total / protofl_downlink_bytes_total   counter (the federation's, restarts included)
    protofl_round_duration_seconds                     histogram
    protofl_accuracy_ratio{kind}                       gauge 0..1 of the last evaluated round: local, global,
                                                       local_proto, global_proto (local: on each device's own
                                                       classes only; ACCURACY_HELP), predictor (the server's,
                                                       start --validation)
    protofl_accuracy_round                             gauge: which round that is
    protofl_journal_fsync_seconds                      histogram (with --state-dir)
    protofl_broker_restarts_total                      counter (the broker `start` spawned)
    protofl_broker_dropped_messages_total              counter: messages the broker dropped after acknowledging
                                                       them ($SYS, since this server started)
    protofl_resend_requests_total                      counter: devices asked to send again after such drops
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from threading import Thread
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from broker_server.watch.board import SnapshotBoard
from broker_server.watch.httpd import BoundedHTTPServer, GuardedHandler
from broker_server.watch.snapshot import ACCURACY_KEYS, MEMBER_STATES, ONLINE
from protofl.errors import ConfigError
from protofl.technique import Phase

log = logging.getLogger("protofl.service")
ROUND_BUCKETS = (1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200)
FSYNC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# What each kind of protofl_accuracy_ratio measures (its label values stay the JSON keys' stems: scrapers use them).
ACCURACY_HELP = (
    "Accuracy of the last evaluated round (0-1), by kind. local, local_proto: each device's model on a held-out "
    "part of its own data, so on its own classes only, not the federation's accuracy on every class; global, "
    "global_proto: each device's model on the test set of every class, averaged; _proto: by the nearest global "
    "prototype instead of the head; predictor: the global predictor on the server's own labelled data "
    "(start --validation)."
)
# The values of protofl_phase: before round 1, each phase of a round, after the last, a stopped server.
PHASES = ("waiting", *(p.value for p in Phase if p is not Phase.DONE), "finished", "stopped")


class SnapshotCollector(Collector):
    """Metric families from the board's latest snapshot (none before the first)."""

    def __init__(self, board: SnapshotBoard) -> None:
        self.board = board

    def collect(self) -> Iterator[Metric]:
        snap = self.board.latest()
        if snap is None:
            return
        info = GaugeMetricFamily(
            "protofl_federation_info", "The federation this server runs.", labels=["fed", "preset"]
        )
        info.add_metric([snap.fed, snap.preset], 1)
        yield info
        yield GaugeMetricFamily("protofl_round", "The open round (the last one once finished).", value=snap.round)
        yield GaugeMetricFamily("protofl_rounds_planned", "Rounds the federation runs (--rounds).", value=snap.rounds)
        yield CounterMetricFamily("protofl_rounds_completed", "Rounds closed.", value=snap.completed)
        current = snap.phase if snap.state == "running" and snap.phase else snap.state
        phase = GaugeMetricFamily("protofl_phase", "1 for the federation's current phase or state.", labels=["phase"])
        for name in PHASES:
            phase.add_metric([name], 1 if name == current else 0)
        yield phase
        if snap.deadline is not None:
            yield GaugeMetricFamily(
                "protofl_phase_deadline_timestamp_seconds",
                "When the open phase closes at the latest (epoch seconds).",
                value=snap.deadline,
            )
        members = GaugeMetricFamily("protofl_members", "Members by state.", labels=["state"])
        for state in MEMBER_STATES:
            members.add_metric([state], snap.count(state))
        yield members
        online = GaugeMetricFamily("protofl_device_online", "1 while the device is connected.", labels=["device"])
        last = GaugeMetricFamily(
            "protofl_device_last_upload_timestamp_seconds",
            "The device's last accepted upload (epoch seconds).",
            labels=["device"],
        )
        skipped = GaugeMetricFamily(
            "protofl_device_skipped_files",
            "Files of the device's data its loader skipped (unreadable), as its last metrics said.",
            labels=["device"],
        )
        for m in snap.members:
            online.add_metric([m.id], 1 if m.state == ONLINE else 0)
            if m.last_upload is not None:
                last.add_metric([m.id], m.last_upload.at)
            skipped.add_metric([m.id], m.skipped_files)
        yield online
        yield skipped
        yield last
        yield _counter("protofl_uploads_accepted", "Uploads accepted.", "kind", snap.accepted)
        yield _counter("protofl_uploads_dropped", "Messages dropped, by reason.", "reason", snap.dropped)
        if snap.privacy is not None:
            for key, help_ in (
                ("epsilon_spent", "Differential privacy: epsilon spent so far (at protofl_dp_delta)."),
                ("epsilon_budget", "Differential privacy: the run's epsilon budget."),
                ("epsilon_per_round", "Differential privacy: one round's epsilon alone."),
                ("delta", "Differential privacy: the delta every epsilon is at."),
            ):
                yield GaugeMetricFamily(f"protofl_dp_{key}", help_, value=snap.privacy[key])
        yield _counter("protofl_uploads_clipped", "Uploads clipped around the global value.", "kind", snap.clipped)
        yield CounterMetricFamily(
            "protofl_uplink_bytes", "Bytes devices sent (joins and uploads).", value=snap.uplink_bytes
        )
        yield CounterMetricFamily(
            "protofl_downlink_bytes", "Bytes the server sent to devices.", value=snap.downlink_bytes
        )
        accuracy = GaugeMetricFamily("protofl_accuracy_ratio", ACCURACY_HELP, labels=["kind"])
        found = snap.last_accuracies()
        if found is not None:
            for key in ACCURACY_KEYS:
                if key in found[1]:
                    accuracy.add_metric([key.removesuffix("_acc")], found[1][key])
            yield GaugeMetricFamily(
                "protofl_accuracy_round", "The round protofl_accuracy_ratio is from.", value=found[0]
            )
        yield accuracy
        yield CounterMetricFamily(
            "protofl_broker_restarts", "Restarts of the broker this server spawned.", value=snap.broker_restarts
        )
        yield CounterMetricFamily(
            "protofl_broker_dropped_messages",
            "Messages the broker dropped after "
            "acknowledging them (a full queue; $SYS/broker/publish/messages/dropped).",
            value=snap.broker_dropped,
        )
        yield CounterMetricFamily(
            "protofl_resend_requests",
            "Devices asked to send again what the broker dropped.",
            value=snap.resend_requests,
        )


def _counter(name: str, doc: str, label: str, values: dict[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=[label])
    for key, value in sorted(values.items()):
        family.add_metric([key], value)
    return family


class FederationMetrics:
    """A registry of its own (not prometheus_client's global one, so that several services can share a
    process): the snapshot collector and the two histograms the service thread observes."""

    def __init__(self, board: SnapshotBoard) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(SnapshotCollector(board))
        self.round_duration = Histogram(
            "protofl_round_duration_seconds",
            "Rounds from opening to close.",
            buckets=ROUND_BUCKETS,
            registry=self.registry,
        )
        self.fsync = Histogram(
            "protofl_journal_fsync_seconds",
            "Journal fsyncs (one per group of uploads).",
            buckets=FSYNC_BUCKETS,
            registry=self.registry,
        )


@dataclass
class HttpEndpoint:
    """A server thread started here; `close()` stops it."""

    server: Any
    thread: Thread | None
    url: str

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _MetricsHandler(GuardedHandler):
    server: _MetricsServer

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        path = self.path.split("?", 1)[0]
        if path in ("/metrics", "/"):
            code, kind, body = 200, CONTENT_TYPE_LATEST, generate_latest(self.server.registry)
        else:
            code, kind, body = 404, "text/plain; charset=utf-8", b"not found: the metrics are at /metrics\n"
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _MetricsServer(BoundedHTTPServer):
    def __init__(self, address: tuple[str, int], registry: CollectorRegistry) -> None:
        self.registry = registry
        super().__init__(address, _MetricsHandler, "/metrics")


def serve_metrics(metrics: FederationMetrics, host: str, port: int) -> HttpEndpoint:
    """Serve `/metrics` on host:port (port 0: any free one) in a thread of its own (httpd.py: `Host`
    checked, connections bounded and timed out)."""
    try:
        server = _MetricsServer((host, port), metrics.registry)
    except OSError as exc:
        raise ConfigError(
            f"--metrics-port {port} on {host}: {exc.strerror or exc} (another port, or 0 for any free one)"
        ) from None
    thread = Thread(target=server.serve_forever, name="protofl-metrics", daemon=True)
    thread.start()
    shown = f"[{host}]" if ":" in host else host
    return HttpEndpoint(server, thread, f"http://{shown}:{server.server_port}/metrics")
