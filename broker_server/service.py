"""The aggregator as a long-running service over MQTT.

One thread owns the `Aggregator`: the MQTT transport only enqueues what arrives (deliver="pump") and
this thread drains the queue, calls `tick()` for deadlines, and publishes. The Aggregator is not
thread-safe and never needs to be. The service's connection carries a last will on `server/status`
("offline"), so devices see a crashed server and re-join when it comes back.
numpy only: nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from broker_server.core.durable import DurableState
from broker_server.core.progress import RoundProgress, accuracies
from broker_server.core.shell import SERVER_ID, Aggregator, RoundRecord
from broker_server.core.stages import ServerModel
from broker_server.ops.capacity import DEFAULT_QUEUE, resend_window, server_receive_maximum, uploads_per_phase
from broker_server.ops.resend import DROPPED_TOPIC, BrokerDrops, Resender, owed
from broker_server.scaleout import shard_wire
from broker_server.scaleout.coordinator import Coordinator
from broker_server.settings import (
    CONNECT_TIMEOUT_S,
    Admission,
    Broker,
    Durability,
    Federation,
    Hooks,
    Pacing,
    Sharding,
    Watchers,
)
from broker_server.watch.live import LiveWatch
from broker_server.watch.observer import round_accuracies
from protofl import topics
from protofl.algorithms.robust import clip_text
from protofl.config import FederationConfig
from protofl.errors import WireError
from protofl.humanize import accuracy_label, human_bytes
from protofl.transport import Connection
from protofl.transport.mqtt import MqttTransport, TransportError, Will
from protofl.wire import Metrics, Resend, Status, encode_message

log = logging.getLogger("protofl.service")
ROUNDS_LOG = "rounds.jsonl"  # in the state dir: a line a round, with its accuracies (start_cli.py writes it)


def round_line(
    rec: RoundRecord, metrics: dict[str, Metrics], rounds: int, so_far: tuple[int, int] | None = None
) -> str:
    """The service's log line for a closed round: participants, accuracies (those reported), bytes, time, and
    the federation's bytes up and down through this round (`so_far`, when given)."""
    parts = [f"round {rec.round}/{rounds}: {len(rec.clients)} clients ({rec.closed_by})"]
    acc = accuracies(metrics.values())
    for key in ("local_acc", "local_proto_acc", "global_acc", "global_proto_acc"):
        value = acc[key]
        if value is not None:  # "local acc (own classes) 81.0%": local is on each device's own classes only
            parts.append(f"{accuracy_label(key, 'acc')} {100 * value:.1f}%")
    parts.append(
        f"up {human_bytes(rec.uplink_bytes)}, down {human_bytes(rec.downlink_bytes)}, {rec.ended - rec.started:.1f} s"
    )
    if so_far is not None:
        parts.append(f"so far up {human_bytes(so_far[0])}, down {human_bytes(so_far[1])}")
    if rec.clip_checked:
        parts.append(f"clipped {clip_text(rec.clipped, rec.clip_checked)}")
    if 0 < len(metrics) < len(rec.clients):
        parts.append(f"metrics from {len(metrics)}/{len(rec.clients)} clients")
    return ", ".join(parts)


def server_transport(broker: Broker, fed: str, *, durable: bool = False) -> MqttTransport:
    """The aggregator service's MQTT connection to `broker`: its last will on `server/status` ("offline"), so
    devices see a crashed server and re-join when it comes back; a persistent session (MQTT 5), so the broker
    queues uploads for it while it reconnects; messages delivered on the service's thread (`pump`); and, `durable`,
    an upload acknowledged only once it is in the journal (manual_ack); retained messages on `up/` refused
    (`refuse_retained`). The default client id is the server's user
    name (security.server_user): a broker that replaces client ids by user names (the generated config does) then
    leaves it as it is."""
    will = Will(
        topics.server_status(fed),
        encode_message(Status(state="offline", detail="aggregator connection lost"), fed=fed, sender=SERVER_ID),
    )
    transport = MqttTransport(
        broker.options,
        broker.client_id or f"protofl-server-{fed}",
        will=will,
        persistent_session=True,
        deliver="pump",
        protocol=broker.protocol,
        manual_ack=durable,
        receive_maximum=server_receive_maximum(),
    )
    # A device never retains an upload or a join: one left retained on its `up/` topic (a hostile member) would be
    # handed to every later run's server as new. It is ignored and cleared (Mosquitto 2.0's ACL cannot refuse the
    # retain flag on a topic it lets a user write).
    transport.refuse_retained(topics.up_all(fed))
    return transport


class AggregatorService:
    """Runs an `Aggregator` against a broker until the federation finishes or `stop()` is called.

    Its settings come grouped (settings.py), built once by the CLI (start_cli.py) or the embedding code:
    `federation` what runs, and optionally who may take part (`admission`), where it survives a crash
    (`durability`), who folds the uploads (`sharding`), how the thread paces itself (`pacing`), who watches
    (`watchers`) and what the caller is told (`hooks`). It is handed its connection (`transport`, a
    `protofl.transport.Connection`: `server_transport` builds the MQTT one; an in-process one runs it in a test),
    which it connects, pumps and closes."""

    def __init__(
        self,
        federation: Federation,
        transport: Connection,
        *,
        admission: Admission | None = None,
        durability: Durability | None = None,
        sharding: Sharding | None = None,
        pacing: Pacing | None = None,
        watchers: Watchers | None = None,
        hooks: Hooks | None = None,
    ) -> None:
        admission, durability = admission or Admission(), durability or Durability()
        sharding, pacing = sharding or Sharding(), pacing or Pacing()
        watchers, self.hooks = watchers or Watchers(), hooks or Hooks()
        cfg, fed = federation.cfg, federation.fed
        self.validation = federation.validation
        self._learning_said: str | None = None
        if durability.enabled and not transport.manual_ack:
            raise ValueError(
                "a durable aggregator acknowledges an upload only once it is journaled: its transport "
                "must acknowledge after the handlers (server_transport(..., durable=True))"
            )
        self.fed = fed
        self.tick_interval = pacing.tick
        self._stop = threading.Event()
        self.rounds = cfg.rounds
        # One log line per round, once its metrics are in (they arrive just after the round closed).
        self.round_log = RoundProgress(self._log_round, grace=pacing.log_grace)
        self.transport = transport
        # With shards (docs/design.md, "Sharded aggregators") a coordinator is composed beside the shell: the same
        # round machine, fed by the shards' progress and partials instead of the uploads, its phases closed by
        # merging their partials. `front` is what the service starts, ticks and makes durable: the coordinator when
        # there is one, else the shell; `aggregator` is always the shell (the state the watchers read).
        common: dict[str, Any] = dict(
            clock=time.time,
            initial_params=federation.initial_params,
            public=federation.public,
            expected_clients=federation.expected_clients,
            members=admission.members,
            policy=federation.policy,
            max_clients=admission.max_clients,
            on_round_end=self._round_end,
            on_metrics=self._metrics,
            offline_grace=federation.offline_grace,
            time_scale=federation.time_scale,
            limits=federation.limits,
        )  # None: the aggregator derives them from the config
        self.coordinator = (
            Coordinator(
                cfg,
                fed,
                self.transport,
                shards=sharding.shards,
                sites=sharding.sites,
                shard_timeout=sharding.timeout,
                **common,
            )
            if sharding.active
            else None
        )
        self.aggregator = self.coordinator.shell if self.coordinator else Aggregator(cfg, fed, self.transport, **common)
        self.front: Aggregator | Coordinator = self.coordinator or self.aggregator
        state_dir = durability.state_dir
        # What watchers see (status, /metrics, the live page): snapshots built on this thread only.
        self.watch = LiveWatch(
            self.aggregator,
            board=watchers.board,
            state_dir=state_dir,
            transport=self.transport,
            metrics=watchers.metrics,
            broker_restarts=watchers.broker_restarts,
            fleet_privacy=watchers.fleet_privacy,
        )
        # Drops the broker reports ($SYS), and the re-send requests they call for (broker_server/ops/resend.py).
        self.broker_drops = BrokerDrops()
        self.site_drops: dict[str, BrokerDrops] = {}  # each bridged site broker's counter (sites/<site>/dropped)
        self.resender = Resender(pacing.resend_window or _default_window(cfg))
        self._resend_at = 0.0
        self.watch.resends = self._resend_counts
        self.durable: DurableState | None = None
        self.resumed = False
        self._connects = 0  # broker connections seen: a new one after the first makes presence stale
        if state_dir is not None:
            self.durable = DurableState(
                state_dir / "aggregator", fed, fsync=durability.fsync, group_commit=durability.group_commit
            )
            self.durable.bind(self.front)
            self.durable.watch_fsync(self.watch.observe_fsync)
            if durability.group_commit:
                self.transport.before_ack = self.durable.sync  # one fsync per pumped batch, then its acks
            self.resumed = self.durable.restore()
            if self.resumed:  # the watch shows what happened before this process: members, counts, accuracies
                self.watch.observer.resumed()
                self.watch.observer.remember(round_accuracies(state_dir / ROUNDS_LOG))
            self.round_log.start_at(self.aggregator.round)  # rounds before the resume were shown already
            # Take up the broker session the crashed process left: the uploads it never acknowledged wait there.
            self.transport.resume_session = self.resumed

    @property
    def finished(self) -> bool:
        return self.aggregator.finished

    def start(self, connect_timeout: float = CONNECT_TIMEOUT_S) -> None:
        self.transport.connect(connect_timeout)
        # A previous run may have left a retained "done" round (devices joining now would stop at once)
        # or a public set this preset does not use: clear them before publishing ours. A resumed
        # federation publishes its own round message again instead.
        if not self.resumed:
            self.transport.publish(topics.round_(self.fed), b"", retain=True)
        if self.aggregator.machine.public is None:
            self.transport.publish(topics.public(self.fed), b"", retain=True)
        # Subscribe before the aggregator announces "waiting": devices join as soon as they see it, and a
        # join that reached the broker before our subscription would be lost. Messages are dispatched
        # only by step(), by when the aggregator's own handler is registered too.
        if self.coordinator is not None:
            self._await_shards(self.coordinator)
        for pattern, _ in self.front.subscriptions():
            self.transport.subscribe(pattern, _ignore)
        self.transport.subscribe(DROPPED_TOPIC, self._on_dropped)  # Mosquitto's; where it is readable
        self.transport.subscribe(topics.site_dropped_all(self.fed), self._on_site_dropped)  # site brokers' (bridged)
        if self.coordinator is not None:
            self.transport.subscribe(topics.shards(self.fed, "gone", "+"), self._on_shard_gone)  # shards' wills
        self.front.start(resume=self.resumed)
        agg = self.aggregator
        quorum = len(agg.expected_clients) if agg.expected_clients else agg.cfg.min_clients
        log.info(
            "aggregator for federation '%s' (%s) on %s; waiting for %d client(s)",
            self.fed,
            agg.cfg.preset,
            self.transport.url,
            quorum,
        )

    def _await_shards(self, coordinator: Coordinator) -> None:
        """Until every shard said it is subscribed (its retained hello): devices join as soon as the federation
        is announced, and an upload published before any shard subscribed would reach nobody."""
        seen: set[str] = set()

        def hello(topic: str, payload: bytes) -> None:
            with contextlib.suppress(WireError):
                seen.add(shard_wire.decode(payload, "hello", 1024)["shard"])

        self.transport.subscribe(topics.shards(self.fed, "hello", "+"), hello)
        said = time.monotonic()
        while not set(coordinator.shards) <= seen and not self._stop.is_set():
            self.transport.pump(0.2)
            if time.monotonic() - said > 10:
                said = time.monotonic()
                log.warning(
                    "waiting for aggregator shard(s) %s (protofl-server shard --index N ...)",
                    ", ".join(sorted(set(coordinator.shards) - seen)),
                )

    def step(self, timeout: float | None = None) -> int:
        """Deliver what arrived (waiting up to `timeout`), then check deadlines; returns messages handled."""
        connects = self.transport.connects
        if connects > self._connects:
            if self._connects:
                self.aggregator.reconnected()
                self.watch.resumed()
            self._connects = connects
        n = self.transport.pump(self.tick_interval if timeout is None else timeout)
        self.front.tick()
        if n:
            self.resender.progress(time.monotonic())
        self._ask_resends()
        # While drops are being asked for again, a round whose metrics are missing waits for the answers.
        self.round_log.poll(time.time(), hold=self.resender.active)
        self.watch.after_step(n)
        return n

    def run(self, *, timeout: float | None = None, until: Callable[[], bool] | None = None) -> None:
        """Serve until the federation finished and its last round is logged, `until()` holds or `stop()`.

        Raises TimeoutError after `timeout` seconds."""
        end = None if timeout is None else time.monotonic() + timeout
        while not self._stop.is_set():
            self.step()
            if until is not None and until():
                return
            if until is None and self.finished and not self.round_log.pending:
                return
            if end is not None and time.monotonic() > end:
                agg = self.aggregator
                raise TimeoutError(
                    f"federation '{self.fed}' did not finish within {timeout:.0f} s: round "
                    f"{agg.round}, {len(agg.clients)} client(s) joined, dropped {agg.dropped}"
                )

    def stop(self) -> None:
        """Ask `run()` to return (thread-safe; e.g. from a signal handler)."""
        self._stop.set()

    def close(self) -> None:
        """Flush the round log, say goodbye on `server/status` (no will is sent) and disconnect."""
        self.round_log.poll(time.time(), force=True)
        self.watch.stopped()
        if not self.finished and self.transport.connected:
            payload = encode_message(
                Status(state="stopped", detail=f"stopped in round {self.aggregator.round}"),
                fed=self.fed,
                sender=SERVER_ID,
                round=self.aggregator.round,
            )
            self.transport.publish(topics.server_status(self.fed), payload, retain=True)
        self.transport.close()
        if self.durable is not None:
            self.durable.close()

    def _on_dropped(self, topic: str, payload: bytes) -> None:
        """The broker's dropped-messages counter: new drops start a re-send episode for the open phase."""
        self._drops_seen(self.broker_drops.observe(payload), "the broker", "--broker-queue")

    def _on_site_dropped(self, topic: str, payload: bytes) -> None:
        """A bridged site broker's counter, as its bridge carried it up: the same, for the devices at that site
        (whose uploads the site broker may drop while the core or the link is slow)."""
        site = topic.split("/")[-2]
        if topic != topics.site_dropped(self.fed, site):
            return
        drops = self.site_drops.setdefault(site, BrokerDrops(from_zero=True))
        self._drops_seen(
            drops.observe(payload), f"site broker '{site}'", f"broker-config --bridge {site} --broker-queue"
        )

    def _on_shard_gone(self, topic: str, payload: bytes) -> None:
        """A shard's will: its session at the broker ended (it vanished --shard-timeout ago and did not come back),
        and with it the uploads, joins and metrics the broker had handed it that it never took. Nobody knows
        which: the devices that still owe the open phase (or their join) are asked again, as after a drop; the
        shared subscription now gives the live shards everything."""
        if not payload:
            return  # cleared: the shard is back
        try:
            shard = shard_wire.decode(payload, "gone", 1024)["shard"]
        except WireError:
            return
        agg = self.coordinator
        if agg is None or shard not in agg.shards or topic != topics.shards(self.fed, "gone", shard):
            return  # not a shard of ours, or a will on another shard's topic
        phase = agg.machine.phase
        where = f"round {agg.round} {phase.phase.value}" if phase is not None else f"round {agg.round} (joins)"
        log.warning(
            "%s is gone: its session at the broker ended (--shard-timeout) with what the broker held for it "
            "in %s. Asking the devices that owe this phase to send again; the other shard(s) take every "
            "upload now (run its `protofl-server shard` command again for it to take part)",
            shard,
            where,
        )
        self.resender.alarm(agg.round, phase.phase.value if phase is not None else "")
        self.watch.changed()

    def _drops_seen(self, new: int, who: str, knob: str) -> None:
        if not new:
            return
        agg = self.aggregator
        phase = agg.machine.phase
        where = f"round {agg.round} {phase.phase.value}" if phase is not None else f"round {agg.round} (joins)"
        log.warning(
            "%s dropped %d message(s) (%d so far, all brokers) in %s after acknowledging them: a queue was "
            "full (%s). Asking the devices that owe this phase to send again",
            who,
            new,
            self._drops_total(),
            where,
            knob,
        )
        self.resender.alarm(agg.round, phase.phase.value if phase is not None else "")
        self.watch.changed()

    def _drops_total(self) -> int:
        return self.broker_drops.total + sum(d.total for d in self.site_drops.values())

    def _ask_resends(self, now: float | None = None) -> None:
        """Send the re-send requests that are due (at most every RESEND_TICK_S, while an episode is on)."""
        if not self.resender.active:
            return
        now = time.monotonic() if now is None else now
        if now - self._resend_at < RESEND_TICK_S:
            return
        self._resend_at = now
        agg = self.aggregator
        # A closed round's missing metrics too: those sent while the broker dropped are long lost, and a device
        # whose metrics are merely on their way sends them twice (the second replaces the first).
        metrics = {r: who for r, (_, who) in self.round_log.awaited().items()}
        asks = self.resender.due(owed(agg.machine, agg.members or agg.expected_clients, metrics), now)
        for a in asks:
            payload = encode_message(Resend(a.ask), fed=self.fed, sender=SERVER_ID, round=a.round, phase=a.phase)
            try:
                self.transport.publish(topics.down(self.fed, a.client), payload, qos=1)
            except TransportError as exc:  # the broker is gone for now: these requests expire and are sent again
                log.warning("could not ask %s to re-send: %s", a.client, exc)
                break
        if asks:
            log.info(
                "asked %d device(s) to re-send (%s)",
                len(asks),
                ", ".join(f"{a.client} {a.ask}" for a in asks[:5]) + (", ..." if len(asks) > 5 else ""),
            )
            self.watch.changed()

    def _resend_counts(self) -> tuple[int, int]:
        return self._drops_total(), self.resender.requests

    def _round_end(self, rec: RoundRecord) -> None:
        self.round_log.round_end(rec)
        self.watch.round_closed(rec)
        if self.hooks.on_round_end is not None:
            self.hooks.on_round_end(rec)

    def _log_round(self, rec: RoundRecord, metrics: dict[str, Metrics]) -> None:
        through = [r for r in self.aggregator.records if r.round <= rec.round]
        so_far = (sum(r.uplink_bytes for r in through), sum(r.downlink_bytes for r in through))
        log.info("%s", round_line(rec, metrics, self.rounds, so_far))
        scored, collapsed = None, None
        validation = self.validation
        if validation is not None:  # the global predictor on the server's own labelled data, this round
            try:
                acc, collapsed = validation.score(self.aggregator.model)
            except RuntimeError as exc:  # the torch side could not embed the refreshed backbone's features
                log.warning("round %d: the global predictor was not scored: %s", rec.round, exc)
                acc = None
            scored = {"predictor_acc": acc}
        accs = self.watch.round_logged(rec, metrics, scored, collapsed)
        note = self.watch.learning.note
        if note is not None and note != self._learning_said:  # protofl/learning.py: said once, with what to do
            self._learning_said = note
            log.warning("the federation is %s", note)
        if self.hooks.on_round_logged is not None:
            self.hooks.on_round_logged(rec, accs, len(metrics))

    def _metrics(self, client: str, round_: int, msg: Metrics, nbytes: int) -> None:
        self.round_log.add_metrics(client, round_, msg)
        if self.hooks.on_metrics is not None:
            self.hooks.on_metrics(client, round_, msg, nbytes)


RESEND_TICK_S = 0.1


def _default_window(cfg: FederationConfig) -> int:
    return resend_window(DEFAULT_QUEUE, uploads_per_phase(cfg))


def _ignore(topic: str, payload: bytes) -> None:
    return None


def save_server_model(model: ServerModel, path: str | Path) -> Path:
    """The federation's agreed state as a plain .npz (no pickle): every array of the active rules' states under
    its field's name (adapter, params, unit prototypes...), the support masks (`masks`), and a table of class
    rows as `<field>` rows with their classes (the mean prototypes: `proto_classes` + `prototypes`)."""
    arrays: dict[str, np.ndarray] = {}
    values = model.rules.state_values()
    values["masks"] = model.rules.support_masks()
    for name, value in values.items():
        if isinstance(value, np.ndarray):
            arrays[name] = np.asarray(value)
        elif isinstance(value, dict) and value and all(isinstance(v, np.ndarray) for v in value.values()):
            classes = sorted(value)
            arrays["proto_classes" if name == "prototypes" else f"{name}_classes"] = np.asarray(classes, np.int64)
            arrays[name] = np.stack([value[c] for c in classes]).astype(np.float32)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp.npz")
    np.savez(tmp, **arrays)  # type: ignore[arg-type]  # numpy's stub lets **arrays reach allow_pickle
    os.replace(tmp, out)  # never leave a half-written model behind
    return out
