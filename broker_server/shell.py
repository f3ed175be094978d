"""The aggregator: the round state machine (rounds.py) behind a thin I/O shell over any `Transport`.

The shell decodes each upload with the federation's limits, checks that the topic's client id is
the message's sender and that the federation is ours, and hands the message to the machine. With a
member list (join credentials or `--allow`), an upload on a non-member's topic is dropped before it
is even decoded, so strangers cost a counter, not memory. It is
the ONE error boundary: whatever is raised while decoding, validating or folding an upload becomes a
counted, logged drop with its reason, and the state is unchanged (the machine and its accumulators
check everything before they change anything). numpy only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np

from broker_server.rounds import OFFLINE_GRACE_S, Drop, RoundMachine, RoundRecord
from broker_server.stages import ServerModel
from protofl import topics
from protofl.adapter import adapter_layout, layout_size
from protofl.algorithms.robust import ClipPolicy
from protofl.config import FederationConfig
from protofl.errors import WireError
from protofl.plan import RoundPlan
from protofl.transport import Transport
from protofl.wire import (
    Config,
    Envelope,
    Join,
    Limits,
    Message,
    Metrics,
    PublicSet,
    RoundStart,
    Status,
    decode_message,
    encode_message,
)

log = logging.getLogger("protofl.server")
SERVER_ID = "server"

__all__ = ["SERVER_ID", "Aggregator", "RoundRecord", "decoder_limits"]


def decoder_limits(cfg: FederationConfig, model_values: int | None = None) -> Limits:
    """The federation's decoder limits (its largest message), known before any broker or machine exists:
    the local broker's packet limit is set from them."""
    adapter = (layout_size(adapter_layout(cfg.proto_dim, cfg.adapter_rank, cfg.num_classes))
               if cfg.federate == "adapter" else 0)
    return RoundPlan.from_config(cfg).limits(model_values, adapter)


class Aggregator:
    def __init__(self, cfg: FederationConfig, fed: str, transport: Transport, *,
                 clock: Callable[[], float] = time.time,
                 initial_params: np.ndarray | None = None,
                 public: PublicSet | None = None,
                 expected_clients: Sequence[str] | None = None,
                 limits: Limits | None = None,
                 members: Sequence[str] | None = None,
                 max_clients: int | None = None,
                 policy: ClipPolicy | None = None,
                 on_round_end: Callable[[RoundRecord], None] | None = None,
                 on_metrics: Callable[[str, int, Metrics, int], None] | None = None,
                 offline_grace: float = OFFLINE_GRACE_S,
                 journal: Callable[[str, bytes, Envelope], None] | None = None,
                 on_boundary: Callable[[], None] | None = None) -> None:
        self.fed = fed
        self.transport = transport
        self.machine = RoundMachine(cfg, self._publish, clock=clock, initial_params=initial_params, public=public,
                                    expected_clients=expected_clients, on_round_end=on_round_end,
                                    on_metrics=on_metrics, policy=policy, offline_grace=offline_grace,
                                    on_boundary=on_boundary)
        # Durability (service.py): `journal(topic, payload, envelope)` makes an accepted upload durable
        # before the machine applies it; it is skipped while the journal itself is replayed, and so is
        # publishing (a restarted aggregator announces its state once, afterwards: `resume()`).
        self.journal = journal
        self.replaying = False
        model_values = None if initial_params is None else int(np.asarray(initial_params).shape[0])
        self.limits = limits or decoder_limits(cfg, model_values)
        self.members = frozenset(members) if members is not None else None  # None: anyone may join
        self.max_clients = max_clients
        self.dropped: dict[str, int] = {}

    # The machine's state, read by services, simulators and tests.
    @property
    def cfg(self) -> FederationConfig:
        return self.machine.cfg

    @property
    def model(self) -> ServerModel:
        return self.machine.model

    @property
    def round(self) -> int:
        return self.machine.round

    @property
    def finished(self) -> bool:
        return self.machine.finished

    @property
    def records(self) -> list[RoundRecord]:
        return self.machine.records

    @property
    def clients(self) -> dict[str, Join]:
        return self.machine.clients

    @property
    def expected_clients(self) -> list[str] | None:
        return self.machine.expected_clients

    def start(self, resume: bool = False) -> None:
        """Announce the federation (or, `resume`d from a checkpoint and journal, its current round and
        phase again) and subscribe to uploads and presence."""
        limits = {"max_message_bytes": self.limits.max_message_bytes}
        if resume:
            self.machine.announce(limits)
        else:
            self.machine.start(limits)
        self.transport.subscribe(topics.up_all(self.fed), self.on_message)
        self.transport.subscribe(topics.presence_all(self.fed), self.on_presence)

    def replay(self, topic: str, payload: bytes) -> None:
        """Apply a journaled upload again (after a restart): the same decoder, checks and machine as live
        traffic, in journal order, so the state is rebuilt exactly; nothing is journaled or published."""
        self.replaying = True
        try:
            self.on_message(topic, payload)
        finally:
            self.replaying = False

    def tick(self, now: float | None = None) -> None:
        """Close the open phase if its deadline has passed (call periodically)."""
        self.machine.tick(now)

    # -- the error boundary ---------------------------------------------------------------------
    def on_message(self, topic: str, payload: bytes) -> None:
        topic_client = topics.client_of(topic)
        nbytes = len(payload)
        if self.members is not None and topic_client not in self.members:
            self._drop("not_member", f"{topic}: '{topic_client}' is not a member of this federation", nbytes)
            return
        try:
            env, msg = decode_message(payload, limits=self.limits)
        except WireError as exc:
            self._drop("malformed", f"{topic}: {exc}", nbytes)
            return
        where = f"{env.kind} from {env.sender} (round {env.round}/{env.phase or '-'})"
        try:
            if env.sender != topic_client:
                raise Drop("sender_mismatch", f"topic says '{topic_client}', message says '{env.sender}'")
            if env.fed != self.fed:
                raise Drop("wrong_fed", f"'{env.fed}' on federation '{self.fed}'")
            if isinstance(msg, Join) and self.max_clients is not None and env.sender not in self.clients \
                    and len(self.clients) >= self.max_clients:
                raise Drop("max_clients", f"join from '{env.sender}': the federation has its {self.max_clients} "
                                          f"clients (--max-clients)")
            if self.journal is not None and not self.replaying and self.machine.needs_journal(env, msg):
                self.journal(topic, payload, env)  # on disk before it changes anything (and before the ack)
            self.machine.receive(env, msg, nbytes)
        except Drop as drop:
            self._drop(drop.reason, drop.detail, nbytes)
        except (WireError, ValueError) as exc:
            self._drop("invalid", f"{where}: {exc}", nbytes)
        except Exception as exc:  # a bug in a stage must not take the federation down with it
            log.exception("unexpected error while handling %s", where)
            self._drop("invalid", f"{where}: {type(exc).__name__}: {exc}", nbytes)

    def on_presence(self, topic: str, payload: bytes) -> None:
        """A device's retained presence (its last will says "offline"): it leaves the round's expected set,
        and is a client again when it is back online. Only a client's own presence counts; the rest
        (strangers, old retained messages) is ignored without a trace."""
        client = topics.client_of(topic)
        if client not in self.clients and client not in self.machine.departed:
            return
        try:
            env, msg = decode_message(payload, limits=self.limits)
        except WireError as exc:
            self._drop("malformed", f"{topic}: {exc}", len(payload))
            return
        if not isinstance(msg, Status) or env.sender != client or env.fed != self.fed:
            self._drop("invalid", f"{topic}: not {client}'s presence", len(payload))
            return
        if msg.detail and msg.state == "online":
            # A device reports a round that failed there on its presence topic (the rest is its profile).
            (log.warning if "failed" in msg.detail else log.debug)("device %s: %s", client, msg.detail)
        if msg.state == "online":
            if self.max_clients is None or client in self.clients or len(self.clients) < self.max_clients:
                self.machine.come_back(client)
        else:  # offline (the will), or left / done
            self.machine.leave(client)

    def _drop(self, reason: str, detail: str, nbytes: int) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        log.info("dropped upload (%s, %d bytes): %s", reason, nbytes, detail)

    # -- outgoing -------------------------------------------------------------------------------
    def _publish(self, msg: Message, round_: int, phase: str) -> int:
        if isinstance(msg, Config):
            topic = topics.config(self.fed)
        elif isinstance(msg, PublicSet):
            topic = topics.public(self.fed)
        elif isinstance(msg, RoundStart):
            topic = topics.round_(self.fed)
        elif isinstance(msg, Status):
            topic = topics.server_status(self.fed)
        else:
            raise TypeError(f"the aggregator does not publish {type(msg).__name__}")
        payload = encode_message(msg, fed=self.fed, sender=SERVER_ID, round=round_, phase=phase)
        if not self.replaying:
            self.transport.publish(topic, payload, retain=True)
        return len(payload)
