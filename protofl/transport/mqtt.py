"""The MQTT transport: paho-mqtt 2.x behind the `Transport` interface.

Threads. A network thread runs paho's `loop()` and does nothing else: `on_message` only enqueues
(topic, payload), so a long training step can never starve keepalives or acks. Handlers run either on
a worker thread (`deliver="thread"`) or on the caller's thread via `pump()` (`deliver="pump"`, what the
aggregator service and the device runner use, so that their state is touched by one thread only).

Faults. The network thread reconnects by itself with exponential backoff and jitter (so a fleet does
not reconnect in lockstep after a broker restart), re-subscribes every filter, and re-publishes the
retained messages this client owns if the broker may have lost them (a broker restarted without
persistence forgets retained messages and sessions). Unacknowledged QoS 1 publishes are resent by
paho. The first connection speaks MQTT 5 and falls back to 3.1.1 when the broker refuses it (amqtt).

Sizes. paho ignores the broker's maximum packet size and an oversize PUBLISH just gets the client
disconnected (and resent, forever, for QoS 1), so `publish` checks the packet size first.
"""

from __future__ import annotations

import logging
import math
import queue
import random
import select
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

from protofl.errors import ProtoFLError
from protofl.names import printable
from protofl.transport.base import Handler, topic_matches
from protofl.transport.broker_url import BrokerOptions, parse_broker_url
from protofl.transport.tls import client_context, explain, probe

log = logging.getLogger("protofl.mqtt")
START_BROKER_HINT = "is it running? (start one with protofl-server start)"
_UNSUPPORTED_PROTOCOL = 132  # CONNACK reason "Unsupported protocol version" (3.1.1 return code 1)
_AUTH_REFUSALS = {134, 135}  # bad user name or password, not authorized
CONNACK_TIMEOUT = 3.0


class TransportError(ProtoFLError, ConnectionError):
    """The broker cannot be reached, refused us, or the transport is closed."""


class PayloadTooLarge(ProtoFLError, ValueError):
    """A message would exceed the broker's maximum packet size; it was not sent."""


@dataclass(frozen=True)
class Will:
    """The last will: published by the broker if this client vanishes without a DISCONNECT.

    `delay` (MQTT 5's will delay interval, seconds): published only if the client has not come back by then, or
    when its session ends, whichever is first; 0: at once."""

    topic: str
    payload: bytes
    retain: bool = True
    qos: int = 1
    delay: int = 0


@dataclass
class Backoff:
    """Exponential reconnect delay with jitter: initial * factor**n, capped, times U(1 - jitter, 1)."""

    initial: float = 0.5
    maximum: float = 30.0
    factor: float = 2.0
    jitter: float = 0.5
    attempt: int = 0
    _rng: random.Random = field(default_factory=random.Random, repr=False)

    def next(self) -> float:
        delay = min(self.maximum, self.initial * self.factor**self.attempt)
        self.attempt += 1
        return delay * (1.0 - self.jitter * self._rng.random())

    def reset(self) -> None:
        self.attempt = 0


@dataclass
class TransportStats:
    connects: int = 0
    disconnects: int = 0
    published: int = 0
    published_bytes: int = 0
    received: int = 0
    received_bytes: int = 0
    handler_errors: int = 0
    inbox_dropped: int = 0  # messages left unhandled: their topic held INBOX_TOPIC_BYTES, or the inbox its total
    retained_refused: int = 0  # retained messages on a topic that `refuse_retained` named: cleared, unhandled


def packet_size(topic: str, payload_len: int, qos: int, mqtt5: bool) -> int:
    """Bytes of the PUBLISH packet on the wire: fixed header, topic, packet id, properties, payload."""
    body = 2 + len(topic.encode()) + (2 if qos else 0) + (1 if mqtt5 else 0) + payload_len
    length_bytes = 1 if body < 128 else 2 if body < 16384 else 3 if body < 2097152 else 4
    return 1 + length_bytes + body


# What the messages of one topic waiting for their handler may hold (one device's `up/` topic on a server): a
# message arriving over it is left unhandled (QoS 1: acknowledged all the same, as a refused message is), so a
# member sending faster than the server reads costs it this much memory, not whatever it sends. A topic with
# fewer than INBOX_TOPIC_MESSAGES waiting always takes its next message, whatever its size: a device's round
# (its uploads, then its metrics) is never cut, even with uploads up to the packet limit.
INBOX_TOPIC_BYTES = 8 * 2**20
INBOX_TOPIC_MESSAGES = 4
# And in all, whatever the number of topics (members x topics x the bound above would be gigabytes): past this a
# message is left unhandled too, except a QoS 1 message that the handlers acknowledge (manual_ack) on a topic with
# fewer than INBOX_TOPIC_MESSAGES waiting. Those the broker's in-flight window bounds instead: it sends the
# client no more unacknowledged QoS 1 messages than that window (Mosquitto's max_inflight_messages, or the
# client's Receive Maximum), so a round's uploads are never cut by another member's flood of QoS 0 messages.
INBOX_TOTAL_BYTES = 256 * 2**20
_MAX_ROUTES = 200_000  # cached topic routes: more than the largest fleet one server holds (~50,000 devices)


WAIT_STEP_S = 0.05


def _wait_set(event: threading.Event, timeout: float) -> bool:
    """`event.wait(timeout)` whatever the clocks say: a device with a wrong clock (no RTC, faketime in the tests)
    may have a monotonic clock that stands still or jumps, and a wait to a deadline on it (Event.wait: an absolute
    deadline on CLOCK_MONOTONIC) then never ends. This waits in steps of a relative timeout (select's), counted, and
    ends after `timeout` seconds of them, or earlier where the monotonic clock says so."""
    steps = max(1, math.ceil(timeout / WAIT_STEP_S))
    end = time.monotonic() + timeout
    for _ in range(steps):
        if event.is_set():
            return True
        select.select([], [], [], WAIT_STEP_S)
        if time.monotonic() > end:
            break
    return event.is_set()


def _filter_topic(pattern: str) -> str:
    """`$share/group/a/+` matches like `a/+` (a shared subscription delivers the plain topic)."""
    if pattern.startswith("$share/"):
        parts = pattern.split("/", 2)
        return parts[2] if len(parts) == 3 else pattern
    return pattern


class _PahoErrors(logging.Logger):
    """paho's logger for one connection: its error lines reach the transport, nothing else is formatted.
    Built directly, not through `logging.getLogger`, so it is not registered and goes with its client."""

    def __init__(self, transport: MqttTransport) -> None:
        super().__init__(f"protofl.mqtt.paho.{transport.client_id}", logging.ERROR)
        self.propagate = False
        self._transport = transport

    def handle(self, record: logging.LogRecord) -> None:
        self._transport._on_paho_error(record.getMessage())


DEFAULT_SESSION_EXPIRY_S = 3600  # a persistent session outlives an hour's outage


class MqttTransport:
    """A `Transport` over one MQTT connection. Call `connect()` before publishing."""

    def __init__(
        self,
        broker: BrokerOptions | str,
        client_id: str,
        *,
        will: Will | None = None,
        persistent_session: bool = False,
        deliver: Literal["thread", "pump"] = "thread",
        protocol: Literal["auto", "5", "3.1.1"] = "auto",
        backoff: Backoff | None = None,
        manual_ack: bool = False,
        resume_session: bool = False,
        session_expiry: int = DEFAULT_SESSION_EXPIRY_S,
        receive_maximum: int | None = None,
    ) -> None:
        self.options = parse_broker_url(broker) if isinstance(broker, str) else broker
        self.client_id = client_id
        self.will = will
        self.persistent_session = persistent_session or resume_session
        # manual_ack: a QoS 1 message is acknowledged only after every handler returned, so a handler that
        # makes it durable first (the aggregator's journal) acknowledges only what survives a crash; what
        # was never acknowledged the broker delivers again. resume_session: the first connection takes up
        # the session a previous process left (MQTT 5, clean start off), with the messages queued for it.
        self.manual_ack = manual_ack
        self.before_ack: Callable[[], None] | None = None  # manual_ack + pump: called before a batch's acks
        self.resume_session = resume_session
        if session_expiry < 1:
            raise ValueError(f"the session expiry must be at least 1 second, got {session_expiry}")
        # How long the broker keeps a persistent session (MQTT 5) while we are gone: its subscriptions, and the
        # QoS 1 messages it queues for us meanwhile (on a shared subscription, our share of the group's).
        self.session_expiry = int(session_expiry)
        # MQTT 5 Receive Maximum: the QoS 1 messages the broker may have delivered to us unacknowledged (None: the
        # broker's own limit, Mosquitto's max_inflight_messages, 20). With manual_ack one journal group commit covers
        # at most this many uploads.
        if receive_maximum is not None and not 1 <= receive_maximum <= 65535:
            raise ValueError(f"the receive maximum must be 1 to 65535 messages, got {receive_maximum}")
        self.receive_maximum = receive_maximum
        self._session = 0  # bumped when the broker has no session for us: older message ids are void
        self.deliver = deliver
        self.backoff = backoff or Backoff()
        self.stats = TransportStats()
        self.last_error = ""
        self._can_downgrade = protocol == "auto"
        self._protocol = paho.MQTTv311 if protocol == "3.1.1" else paho.MQTTv5
        self._lock = threading.RLock()
        self._subs: list[tuple[str, Handler]] = []
        # topic -> the handlers whose pattern matches it: matching a topic against every pattern in Python
        # cost ~30 us a message (a server's uploads, issue 27); emptied when a subscription is added.
        self._routes: dict[str, tuple[Handler, ...]] = {}
        self._patterns: dict[str, None] = {}  # ordered: re-subscribed in the original order
        self._no_retained: list[str] = []  # filters whose retained messages are refused (`refuse_retained`)
        self._retained: dict[str, tuple[bytes, int]] = {}  # topic -> (payload, publish sequence number)
        # QoS >= 1 publishes awaiting PUBACK: mid -> (sequence number, topic). The network thread only
        # appends acknowledged mids to `_acks` (it may hold paho's locks); they are matched under _lock.
        self._pending: dict[int, tuple[int, str]] = {}
        self._acks: deque[tuple[int, int]] = deque()
        self._seq = 0
        self._inbox: queue.SimpleQueue[tuple[str, bytes, int, int, int] | None] = queue.SimpleQueue()
        self.inbox_topic_bytes = INBOX_TOPIC_BYTES
        # topic -> [payload bytes, messages, messages with a payload] of it in the inbox
        self._held: dict[str, list[int]] = {}
        self._held_total = 0  # payload bytes in the inbox, all topics
        self.inbox_total_bytes = INBOX_TOTAL_BYTES
        self._held_lock = threading.Lock()  # never held while taking another lock
        self._left: dict[str, int] = {}  # topic -> messages left unhandled (logged at 1, 10, 100, ...)
        self.arrived: dict[str, float] = {}  # topic -> epoch time its latest message was received
        self._connected = threading.Event()
        self._closing = threading.Event()
        self._ending = threading.Event()  # `expect_end`: the run is over, a lost connection is its end
        self._lost: str | None = None  # a lost connection pump() has yet to report
        self._refused = 0  # the CONNACK reason code of the last refusal, 0 if none
        self._downgrade = False
        self._connack_seen = False
        self._ever_connected = False
        # Why the broker refused this client's credentials after it had let it in (a fleet revoked it: its user is
        # gone from the password file), "" if it did not: a client that reads it stops retrying (`credentials_gone`).
        self._gone = ""
        self._broker_max: int | None = None
        # Why the last TLS connection failed (a refused certificate), and the last such reason warned about.
        self._tls_error: BaseException | None = None
        self._tls_warned = ""
        self._socket_error = ""  # paho's error log of the last failed read (e.g. an SSL alert)
        self._client = self._new_client()
        self._net = threading.Thread(target=self._network_loop, name=f"mqtt-net-{client_id}", daemon=True)
        self._worker: threading.Thread | None = None

    # -- public API -------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return self.options.url

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def connects(self) -> int:
        """Connections made so far (the first, then each reconnection)."""
        return self.stats.connects

    @property
    def protocol(self) -> str:
        return "5" if self._protocol == paho.MQTTv5 else "3.1.1"

    @property
    def max_packet_size(self) -> int:
        limit = self.options.max_packet_size
        return min(limit, self._broker_max) if self._broker_max else limit

    def connect(self, timeout: float = 30.0) -> MqttTransport:
        """Start the network (and worker) threads and wait for the first CONNACK."""
        if not self._net.is_alive():
            self._net.start()
            if self.deliver == "thread":
                self._worker = threading.Thread(target=self._work, name=f"mqtt-work-{self.client_id}", daemon=True)
                self._worker.start()
        if not _wait_set(self._connected, timeout):
            self.close(timeout=0)
            raise TransportError(self._failure_message())
        return self

    @property
    def credentials_gone(self) -> str:
        """Why the broker refuses this client's user now, after it had let it in ("" if it does not): its
        credentials were revoked (a fleet's `devices revoke`) or changed. Retrying cannot help."""
        return self._gone

    def wait_connected(self, timeout: float | None = None) -> bool:
        return self._connected.wait(timeout)

    def publish(self, topic: str, payload: bytes, *, retain: bool = False, qos: int = 1) -> None:
        self.publish_seq(topic, payload, retain=retain, qos=qos)

    def publish_seq(self, topic: str, payload: bytes, *, retain: bool = False, qos: int = 1) -> int:
        """`publish`, returning the message's sequence number in this transport: `acknowledged(seq)` says when the
        broker has it (QoS >= 1)."""
        if self._closing.is_set():
            raise TransportError(f"MQTT transport '{self.client_id}' is closed")
        payload = bytes(payload)
        size, limit = packet_size(topic, len(payload), qos, self._protocol == paho.MQTTv5), self.max_packet_size
        if size > limit:
            from_broker = self._broker_max is not None and self._broker_max <= self.options.max_packet_size
            source = "broker's" if from_broker else "configured"
            raise PayloadTooLarge(
                f"cannot publish {len(payload)} bytes on '{topic}': the MQTT packet would be {size} bytes, over the "
                f"{source} maximum packet size of {limit} bytes; raise max_packet_size (mosquitto.conf and "
                f"BrokerOptions) or shrink the message (e.g. a sparser adapter upload, proto_dtype=f2/q8, "
                f"a smaller model)"
            )
        with self._lock:
            info = self._client.publish(topic, payload, qos=qos, retain=retain)
            self._seq += 1
            seq = self._seq
            if qos and info.rc != MQTTErrorCode.MQTT_ERR_QUEUE_SIZE:
                self._pending[info.mid] = (self._seq, topic)
            if retain:
                # Remember what we own, to re-assert it if the broker forgets it (restart without persistence).
                if payload:
                    self._retained[topic] = (payload, self._seq)
                else:
                    self._retained.pop(topic, None)
            self._match_acks()
        if info.rc == MQTTErrorCode.MQTT_ERR_QUEUE_SIZE:
            raise TransportError(
                f"outgoing MQTT queue of '{self.client_id}' is full; the broker at {self.url} "
                f"has been unreachable for a while ({self.last_error or 'no reason given'})"
            )
        # MQTT_ERR_NO_CONN is fine for QoS >= 1: paho keeps the message and sends it after reconnecting.
        self.stats.published += 1
        self.stats.published_bytes += len(payload)
        return seq

    def acknowledged(self, seq: int) -> bool:
        """Whether the broker acknowledged every QoS >= 1 message this transport published up to sequence number `seq`
        (`publish_seq`'s): what it holds, not merely what was handed to the socket. Cheap: no wait."""
        with self._lock:
            self._match_acks()
            return all(s > seq for s, _ in self._pending.values())

    def subscribe(self, pattern: str, handler: Handler) -> None:
        with self._lock:
            self._subs.append((pattern, handler))
            self._routes.clear()
            self._patterns[pattern] = None
            # Subscribing again re-delivers retained messages, which a new handler expects to see
            # (its older handlers get them again too, as after any reconnect).
            if self._connected.is_set():
                self._subscribe(self._client, pattern)

    def refuse_retained(self, pattern: str) -> None:
        """No message on a topic matching `pattern` is a retained one (a server's devices' `up/` topics: an upload
        or a join left retained would be handed to every later subscriber, a later run's server too). A retained
        one is never handed to the handlers: it is counted (`stats.retained_refused`), logged, and cleared (an empty
        retained message there: this client needs the right to publish on it). Called before `subscribe`: with MQTT
        5 the subscription then asks for the flag as published (retain-as-published), so a message retained while
        this client listens is known too; with 3.1.1 only what the broker held when it subscribed is."""
        with self._lock:
            self._no_retained.append(pattern)

    def _subscribe(self, client: paho.Client, pattern: str) -> None:
        refused = any(topic_matches(f, _filter_topic(pattern)) for f in self._no_retained)
        if refused and self._protocol == paho.MQTTv5:
            client.subscribe(pattern, options=SubscribeOptions(qos=1, retainAsPublished=True))
        else:
            client.subscribe(pattern, qos=1)

    def pump(self, timeout: float = 0.0, max_messages: int = 1000) -> int:
        """Deliver queued messages on this thread (deliver="pump"); waits up to `timeout` for the first.

        With manual_ack and a `before_ack` hook, the messages of one call are acknowledged together after
        the hook returned (group commit: one fsync for a burst of uploads instead of one each)."""
        n = 0
        acks: list[tuple[int, int, int]] | None = [] if self.before_ack is not None else None
        try:
            item = self._inbox.get(timeout=timeout) if timeout > 0 else self._inbox.get_nowait()
            while item is not None:
                self._dispatch(*item, acks=acks)
                n += 1
                if n >= max_messages:
                    break
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass
        lost, self._lost = self._lost, None
        if lost is not None:  # after the messages that came before the connection went (a run's end among them)
            self._say_lost(lost)
        if acks:
            assert self.before_ack is not None
            self.before_ack()
            for mid, qos, session in acks:
                self._ack(mid, qos, session)
        return n

    def waiting(self, topic: str) -> int:
        """How many messages of `topic` with a payload wait in the inbox behind the one being handled (a handler's
        question: is a newer one already here? An empty one, a retained message cleared, is not one)."""
        with self._held_lock:
            held = self._held.get(topic)
            return held[2] if held is not None else 0

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every QoS >= 1 publish so far is acknowledged by the broker."""
        end = time.monotonic() + timeout
        while True:
            with self._lock:
                self._match_acks()
                if not self._pending:
                    return True
            if time.monotonic() >= end or not self._net.is_alive():
                return False
            time.sleep(0.01)

    def close(self, timeout: float = 5.0, send_will: bool = False) -> None:
        """Flush pending publishes (up to `timeout`), DISCONNECT and stop the threads. No will is sent, unless
        `send_will` (MQTT 5: "disconnect with will message", still published only after its delay)."""
        if self._closing.is_set():
            return
        if timeout > 0 and self._connected.is_set():
            self.flush(timeout)
        self._closing.set()
        with self._lock:
            try:
                if send_will and self.will is not None and self._protocol == paho.MQTTv5:
                    with_will = paho.ReasonCode(PacketTypes.DISCONNECT, "Disconnect with will message")
                    self._client.disconnect(reasoncode=with_will)
                else:
                    self._client.disconnect()
            except Exception:  # noqa: BLE001 - closing must not fail because the socket already died
                pass
        self._inbox.put(None)
        for t in (self._net, self._worker):
            if t is not None and t.is_alive() and t is not threading.current_thread():
                t.join(timeout=max(timeout, 1.0))

    def _match_acks(self) -> None:
        """Drop acknowledged publishes from `_pending` (call with _lock held)."""
        while self._acks:
            mid, reason = self._acks.popleft()
            seq_topic = self._pending.pop(mid, None)
            if seq_topic is not None and reason >= 128:
                log.warning(
                    "%s: the broker at %s refused our message on '%s' (reason %d); check its ACL",
                    self.client_id,
                    self.url,
                    seq_topic[1],
                    reason,
                )

    # -- paho plumbing --------------------------------------------------------------------------
    def _new_client(self) -> paho.Client:
        v5 = self._protocol == paho.MQTTv5
        # 3.1.1 cannot ask for a clean session on the first connect only, so it always starts clean:
        # otherwise a restarted aggregator would be handed the previous run's queued joins.
        opts = self.options
        client = paho.Client(
            CallbackAPIVersion.VERSION2,
            client_id=self.client_id,
            protocol=self._protocol,
            clean_session=None if v5 else True,
            reconnect_on_failure=False,
            manual_ack=self.manual_ack,
            transport="unix" if opts.unix_path else "tcp",
        )
        client.connect_timeout = 5.0
        if opts.username is not None:
            client.username_pw_set(opts.username, opts.password)
        if opts.tls:
            client.tls_set_context(client_context(opts))
        # paho formats a debug line for every packet when an on_log callback is set (~10 us a message with
        # MQTT 5 properties); a logger is asked first whether the level is wanted, so only errors cost.
        client.enable_logger(_PahoErrors(self))
        if self.will is not None:
            will_props = None
            if self.will.delay and self._protocol == paho.MQTTv5:
                will_props = Properties(PacketTypes.WILLMESSAGE)
                will_props.WillDelayInterval = self.will.delay
            client.will_set(
                self.will.topic, self.will.payload, qos=self.will.qos, retain=self.will.retain, properties=will_props
            )
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_publish = self._on_publish
        # Registering a write callback is paho's "external event loop" mode: publish() then only queues
        # the packet and wakes our loop, instead of writing to the socket from the caller's thread while
        # the network thread may be writing too (interleaved bytes on large messages).
        client.on_socket_register_write = _no_op
        client.on_socket_unregister_write = _no_op
        return client

    def _open(self, client: paho.Client, first: bool) -> None:
        self._socket_error = ""
        if not first:
            client.reconnect()
            return
        host = self.options.unix_path or self.options.host  # paho's unix transport takes the path as host
        if self._protocol == paho.MQTTv5:
            props = None
            if self.persistent_session or self.receive_maximum is not None:
                props = Properties(PacketTypes.CONNECT)
                if self.persistent_session:
                    # Keep our subscriptions and queue QoS 1 uploads at the broker while we reconnect.
                    props.SessionExpiryInterval = self.session_expiry
                if self.receive_maximum is not None:
                    props.ReceiveMaximum = self.receive_maximum
            clean: paho.CleanStartOption = paho.MQTT_CLEAN_START_FIRST_ONLY if self.persistent_session else True
            if self.resume_session:
                clean = False
            client.connect(host, self.options.port, self.options.keepalive, clean_start=clean, properties=props)
        else:
            client.connect(host, self.options.port, self.options.keepalive)

    def _network_loop(self) -> None:
        need_open, first, opened = True, True, time.monotonic()
        while not self._closing.is_set():
            with self._lock:
                client = self._client
            if need_open:
                try:
                    self._connack_seen = False
                    opened = time.monotonic()
                    self._open(client, first)
                    need_open, first = False, False
                except Exception as exc:  # noqa: BLE001 - any failure to connect is retried
                    self.last_error = _describe(exc)
                    log.debug("%s: connect to %s failed: %s", self.client_id, self.url, self.last_error)
                    self._note_tls_failure(exc)
                    self._closing.wait(self.backoff.next())
                    continue
            rc = client.loop(timeout=0.2)
            if not self._connack_seen and time.monotonic() - opened > CONNACK_TIMEOUT:
                # A broker that accepts TCP but never answers our CONNECT (amqtt given an MQTT 5 CONNECT
                # with a will) would otherwise hold us until the keepalive expires.
                self.last_error = f"no CONNACK within {CONNACK_TIMEOUT:.0f} s"
                with self._lock:
                    client.disconnect()
                rc = MQTTErrorCode.MQTT_ERR_CONN_LOST
            if rc in (MQTTErrorCode.MQTT_ERR_SUCCESS, MQTTErrorCode.MQTT_ERR_AGAIN):
                continue
            if self._closing.is_set():
                break
            need_open = True
            if not self._connack_seen and self._socket_error:
                self.last_error = self._socket_error
            tls_failed = self.options.tls and "ssl" in self._socket_error.lower()
            if (
                not self._connack_seen
                and not self._ever_connected
                and self._can_downgrade
                and self._protocol == paho.MQTTv5
                and not tls_failed
            ):
                # Some 3.1.1-only brokers drop an MQTT 5 CONNECT without answering (amqtt does when
                # it carries a will), rather than refusing it with a CONNACK.
                self._downgrade = True
            if self._downgrade:
                # The broker refused MQTT 5 (amqtt speaks 3.1.1): start over with a 3.1.1 client. Only
                # happens before the first CONNACK, so no publish can be lost with the old client.
                with self._lock:
                    self._downgrade, self._protocol, first = False, paho.MQTTv311, True
                    self._client = self._new_client()
                log.info("%s: broker at %s does not speak MQTT 5; using MQTT 3.1.1", self.client_id, self.url)
                continue
            if not self._refused and self._connack_seen:
                self.last_error = f"connection lost ({paho.error_string(rc)})"
            self._closing.wait(self.backoff.next())

    def _note_tls_failure(self, exc: BaseException) -> None:
        """Keep a refused broker certificate for the error message, and warn once per reason: a device
        that refuses whatever now holds the broker's port says so while it keeps retrying."""
        if not self.options.tls or not isinstance(exc, (ssl.SSLError, ssl.CertificateError)):
            return
        self._tls_error = exc
        why = explain(exc, self.options)
        if why is not None and why != self._tls_warned:
            self._tls_warned = why
            log.warning("%s: refusing the connection: %s; retrying with backoff", self.client_id, why)

    def _on_paho_error(self, message: str) -> None:
        # paho reports a failed read (an SSL alert, a reset) only through its log.
        if message.startswith("failed to receive on socket"):
            self._socket_error = message

    def _on_connect(
        self,
        client: paho.Client,
        userdata: object,
        flags: paho.ConnectFlags,
        reason: paho.ReasonCode,
        properties: Properties | None,
    ) -> None:
        self._connack_seen = True
        if reason.is_failure:
            if (
                reason.value == _UNSUPPORTED_PROTOCOL
                and self._protocol == paho.MQTTv5
                and self._can_downgrade
                and not self._ever_connected
            ):
                self._downgrade = True
                self.last_error = "broker refused MQTT 5"
            else:
                self._refused = reason.value
                self.last_error = str(reason)
                if reason.value in _AUTH_REFUSALS and self._ever_connected and self.options.username:
                    self._gone = str(reason)
            return
        self._refused = 0
        self._tls_error, self._tls_warned = None, ""
        self._broker_max = getattr(properties, "MaximumPacketSize", None) if properties is not None else None
        self.stats.connects += 1
        session_kept = flags.session_present and self.persistent_session
        if not flags.session_present:
            self._session += 1
        # Under _lock, so that a concurrent subscribe() either is in this list or sees us connected.
        with self._lock:
            self._match_acks()
            for pattern in self._patterns:
                self._subscribe(client, pattern)
            unacked = {seq for seq, _ in self._pending.values()}
            for topic, (payload, seq) in list(self._retained.items()):
                # Only acknowledged ones: paho resends an unacknowledged message itself, in order, and a
                # cached copy sent first would reorder it. The will topic is always re-asserted: the
                # broker may just have published our will over it.
                is_will = self.will is not None and topic == self.will.topic
                if seq not in unacked and (is_will or not session_kept):
                    info = client.publish(topic, payload, qos=1, retain=True)
                    self._seq += 1
                    self._pending[info.mid] = (self._seq, topic)
                    self._retained[topic] = (payload, self._seq)
            self._connected.set()
        if self._ever_connected:
            log.info("%s: reconnected to %s after %d attempt(s)", self.client_id, self.url, self.backoff.attempt)
        else:
            log.info("%s: connected to %s (MQTT %s)", self.client_id, self.url, self.protocol)
        self._ever_connected = True
        self.backoff.reset()
        self.last_error = ""

    def _on_disconnect(
        self,
        client: paho.Client,
        userdata: object,
        flags: paho.DisconnectFlags,
        reason: paho.ReasonCode,
        properties: Properties | None,
    ) -> None:
        was_connected = self._connected.is_set()
        self._connected.clear()
        if was_connected:
            self.stats.disconnects += 1
            if not self._closing.is_set():
                if self.deliver == "pump":
                    self._lost = str(reason)  # said by pump(), after the messages that came before it
                else:
                    self._say_lost(str(reason))

    def expect_end(self, ending: bool = True) -> None:
        """The other side is done (the run this client served finished): a connection lost from now on is the end
        of the run (the server stopped its broker), said as such, not a fault and a reconnect. `ending=False`: a
        new run is served (a fleet's), a lost connection is a fault again."""
        if ending:
            self._ending.set()
        else:
            self._ending.clear()

    def _say_lost(self, reason: str) -> None:
        if self._ending.is_set():
            log.info("%s: %s closed the connection after the run ended (%s)", self.client_id, self.url, reason)
        else:
            log.warning("%s: lost connection to %s (%s); reconnecting with backoff", self.client_id, self.url, reason)

    def _on_publish(
        self, client: paho.Client, userdata: object, mid: int, reason: paho.ReasonCode, properties: Properties | None
    ) -> None:
        self._acks.append((mid, reason.value if reason is not None else 0))

    def _on_message(self, client: paho.Client, userdata: object, msg: paho.MQTTMessage) -> None:
        self.stats.received += 1
        self.stats.received_bytes += len(msg.payload)
        # When it came off the wire, not when a busy consumer got to it (link timing in simulations).
        self.arrived[msg.topic] = time.time()
        if msg.retain and self._no_retained and any(topic_matches(f, msg.topic) for f in self._no_retained):
            self._refuse_retained(client, msg)
            return
        n = len(msg.payload)
        with self._held_lock:
            held = self._held.get(msg.topic)
            if held is None:
                held = self._held[msg.topic] = [0, 0, 0]
            windowed = self.manual_ack and msg.qos > 0 and held[1] < INBOX_TOPIC_MESSAGES
            over = (held[1] >= INBOX_TOPIC_MESSAGES and held[0] + n > self.inbox_topic_bytes) or (
                not windowed and self._held_total + n > self.inbox_total_bytes
            )
            if not over:
                held[0] += n
                held[2] += n > 0
                self._held_total += n
            if not over or (self.manual_ack and msg.qos > 0):  # queued: the message, or its acknowledgement
                held[1] += 1
            waiting = held[0]
        if over:
            self._leave(msg, waiting)
            return
        # paho types the payload bytes | bytearray; it decodes bytes, which bytes() returns as is (no copy).
        self._inbox.put((msg.topic, bytes(msg.payload), msg.mid, msg.qos, self._session))

    def _refuse_retained(self, client: paho.Client, msg: paho.MQTTMessage) -> None:
        """A retained message where none may be (`refuse_retained`): cleared, counted, never handled."""
        if msg.payload:
            self.stats.retained_refused += 1
            n = self.stats.retained_refused
            client.publish(msg.topic, b"", qos=1, retain=True)  # the broker forgets it: no later subscriber gets it
            if n == 10 ** (len(str(n)) - 1):  # 1, 10, 100, ...
                log.warning(
                    "%s: ignored and cleared a retained message on '%s' (%d bytes; %d so far): nothing is retained "
                    "there, so that no later subscriber takes it as new",
                    self.client_id,
                    printable(msg.topic),
                    len(msg.payload),
                    n,
                )
        if self.manual_ack and msg.qos > 0:
            self._inbox.put((msg.topic, b"", msg.mid, msg.qos, self._session))  # only its acknowledgement

    def _leave(self, msg: paho.MQTTMessage, held: int) -> None:
        """Leave `msg` unhandled: its topic has `held` bytes waiting already, or the inbox its total. A QoS 1
        message the handlers acknowledge (manual_ack) is acknowledged all the same, or the broker would hold it in
        flight."""
        self.stats.inbox_dropped += 1
        if len(self._left) >= _MAX_ROUTES:
            self._left.clear()
        count = self._left[msg.topic] = self._left.get(msg.topic, 0) + 1
        if count == 10 ** (len(str(count)) - 1):  # 1, 10, 100, ...: a flood costs its log a few lines
            log.warning(
                "%s: left %d message(s) on '%s' unhandled: %d bytes of that topic (at most %d) and %d in all "
                "(at most %d) wait for their handlers already",
                self.client_id,
                count,
                printable(msg.topic),
                held,
                self.inbox_topic_bytes,
                self._held_total,
                self.inbox_total_bytes,
            )
        if self.manual_ack and msg.qos > 0:
            self._inbox.put((msg.topic, b"", msg.mid, msg.qos, self._session))  # only its acknowledgement

    # -- delivery -------------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            item = self._inbox.get()
            if item is None:
                return
            self._dispatch(*item)

    def _dispatch(
        self,
        topic: str,
        payload: bytes,
        mid: int = 0,
        qos: int = 0,
        session: int = 0,
        acks: list[tuple[int, int, int]] | None = None,
    ) -> None:
        with self._held_lock:
            held = self._held.get(topic)
            if held is not None:
                held[0] -= len(payload)
                held[1] -= 1
                held[2] -= len(payload) > 0
                self._held_total -= len(payload)
                if held[1] <= 0:
                    del self._held[topic]
        if payload:  # an empty retained payload only clears a retained message; nothing to handle
            with self._lock:
                handlers = self._routes.get(topic)
                if handlers is None:
                    if len(self._routes) >= _MAX_ROUTES:  # a fleet's topics: bounded, rebuilt as they come
                        self._routes.clear()
                    handlers = self._routes[topic] = tuple(
                        h for p, h in self._subs if topic_matches(_filter_topic(p), topic)
                    )
            for handler in handlers:
                try:
                    handler(topic, payload)
                except Exception:  # noqa: BLE001 - one bad message must not stop the device or the server
                    self.stats.handler_errors += 1
                    log.exception("%s: handler for '%s' failed", self.client_id, topic)
        if self.manual_ack and qos > 0:
            if acks is not None:
                acks.append((mid, qos, session))  # acknowledged by pump() once before_ack() returned
            else:
                self._ack(mid, qos, session)

    def _ack(self, mid: int, qos: int, session: int) -> None:
        with self._lock:
            # An id from a session the broker no longer has may now name another message: not ours to
            # acknowledge (the broker forgot the old one; a sender resends it).
            if session == self._session:
                self._client.ack(mid, qos)

    def _failure_message(self) -> str:
        reason = self.last_error or "no answer before the timeout"
        if self._refused:
            hint = (
                "check --username/--password"
                if self._refused in _AUTH_REFUSALS
                else "check the client id, credentials and the broker's configuration"
            )
            return f"broker at {self.url} refused the connection ({reason}); {hint}"
        why = self._tls_explanation()
        if why is not None:
            return f"TLS failed: {why}"
        if "SSL" in reason or "certificate" in reason.lower():
            return (
                f"TLS with the broker at {self.url} failed: {reason}; check --tls-ca/--tls-cert/--tls-key and "
                f"that the URL's host name matches the broker's certificate"
            )
        return f"cannot reach broker at {self.url}: {reason}; {START_BROKER_HINT}"

    def _tls_explanation(self) -> str | None:
        """Why TLS failed, in words: from the refused handshake, or, when the broker just closed the
        connection after it (as one that demands a client certificate does), from a listening probe."""
        if not self.options.tls or self._ever_connected:
            return None
        if self._tls_error is not None:
            return explain(self._tls_error, self.options)
        if self._socket_error or not self._connack_seen:
            return explain(probe(self.options), self.options)
        return None


def _no_op(*args: object) -> None:
    return None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError):
        return f"SSL error: {exc}"
    text = str(exc) or type(exc).__name__
    return text if isinstance(exc, OSError) else f"{type(exc).__name__}: {text}"
