"""The aggregator: the round state machine over any `Transport` (numpy only).

Round r: open -> [ERPA: "proto" phase -> anchors] -> "train" phase -> fold into the server model.
A phase closes when every expected client has sent what the phase needs, or at its deadline
(`tick()`), provided at least `min_clients` did. Uploads that are late, duplicated, for the wrong
phase, from an unknown client, or whose topic id differs from the sender are dropped and counted;
they change nothing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from broker_server.stages import PrototypePhase, ServerModel, TrainPhase, table_protoset
from protofl import topics
from protofl.algorithms import cps, refine
from protofl.config import FederationConfig
from protofl.errors import WireError
from protofl.transport import Transport
from protofl.wire import (DEFAULT_LIMITS, AdapterUpload, Config, Envelope, Join, Limits, Metrics, ProtoUpload,
                          PublicSet, RoundStart, Status, decode_message, encode_message)
from protofl.adapter import adapter_layout, initial_adapter

log = logging.getLogger("protofl.server")
SERVER_ID = "server"
PROTOCOL_KINDS = ("join", "protos", "adapter")  # counted as uplink; metrics are evaluation traffic


@dataclass
class RoundRecord:
    round: int
    clients: list[str] = field(default_factory=list)
    uplink_bytes: int = 0
    downlink_bytes: int = 0
    started: float = 0.0
    ended: float = 0.0
    closed_by: str = ""


@dataclass
class _Phase:
    name: str
    expected: set[str]
    kinds: tuple[str, ...]
    deadline: float
    received: dict[str, set[str]] = field(default_factory=dict)

    def complete(self, client: str) -> bool:
        return set(self.kinds) <= self.received.get(client, set())

    def done_clients(self) -> list[str]:
        return sorted(c for c in self.received if self.complete(c))


class Aggregator:
    def __init__(self, cfg: FederationConfig, fed: str, transport: Transport, *,
                 clock: Callable[[], float] = time.time,
                 initial_params: np.ndarray | None = None,
                 public: PublicSet | None = None,
                 expected_clients: Sequence[str] | None = None,
                 limits: Limits = DEFAULT_LIMITS,
                 on_round_end: Callable[[RoundRecord], None] | None = None,
                 on_metrics: Callable[[str, int, Metrics, int], None] | None = None) -> None:
        self.cfg = cfg
        self.fed = fed
        self.transport = transport
        self.clock = clock
        self.limits = limits
        self.public = public
        self.expected_clients = sorted(expected_clients) if expected_clients else None
        self.on_round_end = on_round_end
        self.on_metrics = on_metrics
        self.model = ServerModel(cfg)
        if cfg.cps:
            self.model.masks = cps.make_masks(cfg.num_classes, cfg.proto_dim, cfg.s, seed=cfg.seed)
        if cfg.federate == "adapter":
            self.layout = adapter_layout(cfg.proto_dim, cfg.adapter_rank, cfg.num_classes)
            self.model.adapter = initial_adapter(self.layout, seed=cfg.seed)
        else:
            self.layout = []
        if cfg.federate == "full":
            # Without an initial vector the devices start from the config seed's model (identical
            # everywhere); the simulator passes the vector so that round 1's downlink is counted.
            self.model.params = None if initial_params is None else np.asarray(initial_params, np.float32)
        if cfg.prototypes == "unit":
            self.model.unit = refine.initial_prototypes(cfg.num_classes, cfg.proto_dim, cfg.seed)
        self.clients: dict[str, Join] = {}
        self.round = 0
        self.phase: _Phase | None = None
        self.proto_acc: PrototypePhase | None = None
        self.train_acc: TrainPhase | None = None
        self.anchors = None
        self.records: list[RoundRecord] = []
        self.current: RoundRecord = RoundRecord(round=1)
        self.dropped: dict[str, int] = {}
        self.finished = False
        self._config_payload = b""
        self._public_payload = b""

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self._config_payload = encode_message(
            Config(preset=self.cfg.preset, params=self.cfg.to_dict(), adapter_layout=self.layout,
                   class_masks=self.model.masks, limits={"max_message_bytes": self.limits.max_message_bytes}),
            fed=self.fed, sender=SERVER_ID)
        self.transport.publish(topics.config(self.fed), self._config_payload, retain=True)
        if self.cfg.erpa and self.public is not None:
            self._public_payload = encode_message(self.public, fed=self.fed, sender=SERVER_ID)
            self.transport.publish(topics.public(self.fed), self._public_payload, retain=True)
        self._status("waiting", f"0/{self._quorum()} clients")
        self.transport.subscribe(topics.up_all(self.fed), self.on_message)

    def _status(self, state: str, detail: str = "") -> None:
        payload = encode_message(Status(state=state, detail=detail), fed=self.fed, sender=SERVER_ID,
                                 round=self.round)
        self.transport.publish(topics.server_status(self.fed), payload, retain=True)

    def _quorum(self) -> int:
        return len(self.expected_clients) if self.expected_clients else self.cfg.min_clients

    def _drop(self, reason: str, detail: str, nbytes: int = 0) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        log.info("dropped upload (%s, %d bytes): %s", reason, nbytes, detail)

    # -- incoming -------------------------------------------------------------------------------
    def on_message(self, topic: str, payload: bytes) -> None:
        topic_client = topics.client_of(topic)
        try:
            env, msg = decode_message(payload, limits=self.limits)
        except WireError as exc:
            self._drop("malformed", f"{topic}: {exc}", len(payload))
            return
        if env.sender != topic_client:
            self._drop("sender_mismatch", f"topic says '{topic_client}', message says '{env.sender}'", len(payload))
            return
        if env.fed != self.fed:
            self._drop("wrong_fed", f"'{env.fed}' on federation '{self.fed}'", len(payload))
            return
        try:
            if isinstance(msg, Join):
                self._on_join(env, msg, len(payload))
            elif isinstance(msg, Metrics):
                self._on_metrics(env, msg, len(payload))
            elif isinstance(msg, (ProtoUpload, AdapterUpload)):
                self._on_upload(env, msg, len(payload))
            else:
                self._drop("unexpected_kind", f"'{env.kind}' from {env.sender}", len(payload))
        except WireError as exc:
            self._drop("invalid", f"{env.kind} from {env.sender} (round {env.round}): {exc}", len(payload))

    def _on_join(self, env: Envelope, msg: Join, nbytes: int) -> None:
        if self.expected_clients and env.sender not in self.expected_clients:
            self._drop("unknown_client", f"'{env.sender}' is not in this federation's client list", nbytes)
            return
        new = env.sender not in self.clients
        self.clients[env.sender] = msg
        self.current.uplink_bytes += nbytes
        if new:
            # The device receives the retained config and public set once.
            self.current.downlink_bytes += len(self._config_payload) + len(self._public_payload)
            log.info("client %s joined (%s, %d samples); %d/%d", env.sender, msg.arch or "default arch",
                     msg.n_samples, len(self.clients), self._quorum())
        if self.round == 0 and not self.finished and len(self.clients) >= self._quorum():
            self._open_round(1)
        elif self.phase is not None and new:
            self.phase.expected.add(env.sender)

    def _on_metrics(self, env: Envelope, msg: Metrics, nbytes: int) -> None:
        if env.sender not in self.clients:
            self._drop("unknown_client", f"metrics from '{env.sender}'", nbytes)
            return
        if self.on_metrics is not None:
            self.on_metrics(env.sender, env.round, msg, nbytes)

    def _on_upload(self, env: Envelope, msg: ProtoUpload | AdapterUpload, nbytes: int) -> None:
        if env.sender not in self.clients:
            self._drop("unknown_client", f"'{env.sender}' sent {env.kind} without joining", nbytes)
            return
        phase = self.phase
        passed_phase = (self.cfg.two_phase and env.round == self.round and phase is not None
                        and env.phase == "proto" and phase.name == "train")
        if phase is None or env.round < self.round or passed_phase:
            self._drop("stale", f"{env.kind} for round {env.round}/{env.phase} from {env.sender}; "
                                f"now round {self.round}/{phase.name if phase else '-'}", nbytes)
            return
        if env.round > self.round or env.phase != phase.name:
            self._drop("wrong_phase", f"{env.kind} for round {env.round}/{env.phase}, now {self.round}/{phase.name}",
                       nbytes)
            return
        got = phase.received.get(env.sender, set())
        if env.kind in got:
            self._drop("duplicate", f"second {env.kind} from {env.sender} in round {env.round}/{env.phase}", nbytes)
            return
        if env.kind not in phase.kinds:
            self._drop("wrong_phase", f"{env.kind} is not part of the {phase.name} phase", nbytes)
            return
        if isinstance(msg, AdapterUpload) and self.cfg.federate == "adapter" and msg.base_round != self.round:
            self._drop("stale", f"adapter trained from round {msg.base_round}'s adapter, now {self.round}", nbytes)
            return
        # Validation happens inside add(); an invalid upload raises before any state changes.
        if phase.name == "proto":
            assert self.proto_acc is not None and isinstance(msg, ProtoUpload)
            self.proto_acc.add(msg)
        elif isinstance(msg, AdapterUpload):
            assert self.train_acc is not None
            self.train_acc.add_adapter(msg)
        else:
            assert self.train_acc is not None
            self.train_acc.add_prototypes(msg)
        phase.received[env.sender] = got | {env.kind}
        self.current.uplink_bytes += nbytes
        if all(phase.complete(c) for c in phase.expected):
            self._close_phase("quorum")

    # -- phases ---------------------------------------------------------------------------------
    def _train_kinds(self) -> tuple[str, ...]:
        kinds = []
        if self.cfg.federate != "none":
            kinds.append("adapter")
        if self.cfg.prototypes != "none" and not self.cfg.erpa:
            kinds.append("protos")
        return tuple(kinds)

    def _open_round(self, r: int) -> None:
        self.round = r
        self.current.round = r
        self.current.started = self.clock()
        if self.cfg.two_phase:
            self.proto_acc = PrototypePhase(self.model)
            self._open_phase("proto", ("protos",), RoundStart(
                deadline=0.0, adapter=self.model.adapter, params=None, anchors=None, anchor_kind="",
                participants=None, final=False, dt=self.cfg.adapter_dtype))
        else:
            self._open_train()

    def _open_train(self) -> None:
        self.train_acc = TrainPhase(self.model)
        erpa = self.cfg.two_phase
        anchors = self.anchors if erpa else self.model.train_anchors()
        self._open_phase("train", self._train_kinds(), RoundStart(
            deadline=0.0,
            adapter=None if erpa else self.model.adapter,  # ERPA sent it with the prototype phase
            params=self.model.params,
            anchors=anchors, anchor_kind=self.model.anchor_kind() if anchors is not None else "",
            participants=None, final=False, dt=self.cfg.adapter_dtype))

    def _open_phase(self, name: str, kinds: tuple[str, ...], msg: RoundStart) -> None:
        deadline = self.clock() + self.cfg.round_timeout
        msg = RoundStart(deadline=deadline, adapter=msg.adapter, params=msg.params, anchors=msg.anchors,
                         anchor_kind=msg.anchor_kind, participants=msg.participants, final=msg.final, dt=msg.dt)
        self.phase = _Phase(name, set(self.clients), kinds, deadline)
        payload = encode_message(msg, fed=self.fed, sender=SERVER_ID, round=self.round, phase=name)
        self.current.downlink_bytes += len(payload) * len(self.clients)
        self._status("running", f"round {self.round}/{self.cfg.rounds} {name}")
        self.transport.publish(topics.round_(self.fed), payload, retain=True)

    def tick(self, now: float | None = None) -> None:
        """Close the open phase if its deadline has passed (call periodically)."""
        phase = self.phase
        if phase is None or self.finished:
            return
        now = self.clock() if now is None else now
        if now < phase.deadline:
            return
        done = phase.done_clients()
        if len(done) >= self.cfg.min_clients:
            self._close_phase("deadline")
        else:
            log.warning("round %d %s: deadline passed with %d/%d clients (min %d); waiting another %.0fs",
                        self.round, phase.name, len(done), len(phase.expected), self.cfg.min_clients,
                        self.cfg.round_timeout)
            phase.deadline = now + self.cfg.round_timeout

    def _close_phase(self, why: str) -> None:
        phase = self.phase
        assert phase is not None
        if phase.name == "proto":
            assert self.proto_acc is not None
            table = self.proto_acc.anchors()
            self.anchors = table_protoset(table, self.model.proto_width, self.cfg.proto_dtype) if table else None
            self.proto_acc = None
            self._open_train()
            return
        assert self.train_acc is not None
        self.train_acc.finish()
        self.train_acc = None
        self.phase = None
        rec = self.current
        rec.clients = phase.done_clients()
        rec.ended = self.clock()
        rec.closed_by = why
        self.records.append(rec)
        log.info("round %d: %d/%d clients (%s), up %s, down %s", rec.round, len(rec.clients), len(phase.expected),
                 why, _human(rec.uplink_bytes), _human(rec.downlink_bytes))
        self.current = RoundRecord(round=rec.round + 1)
        if self.on_round_end is not None:
            self.on_round_end(rec)
        if rec.round >= self.cfg.rounds:
            self._finish()
        else:
            self._open_round(rec.round + 1)

    def _finish(self) -> None:
        self.finished = True
        payload = encode_message(RoundStart(deadline=self.clock(), adapter=self.model.adapter, params=self.model.params,
                                            anchors=None, anchor_kind="", participants=None, final=True,
                                            dt=self.cfg.adapter_dtype),
                                 fed=self.fed, sender=SERVER_ID, round=self.round, phase="done")
        self.transport.publish(topics.round_(self.fed), payload, retain=True)
        self._status("finished", f"{self.round} rounds")


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
