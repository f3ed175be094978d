"""A lite device's loop over MQTT (issue 57): `protofl-edge join` without torch, onnxruntime and numpy alone.

What a lite device can do in a federation is protofl/lite.py's rule; this is its loop. In the order of the torch
device's (edge_agent/ops/runner.py): connect (last will: presence "offline"), announce presence "online", read the
retained `config` and refuse a federation it cannot serve (the reason on its presence topic, retained, and on
stderr); load its data; when the server's status says it is up, read the retained `public` message (the shared
backbone's vector and its ONNX graph: edge_agent/inference/lite_backbone.py), join saying it trains nothing
(`Join.trains` false), and follow the retained `round` messages: in the training phase it uploads its ridge
statistics of the backbone's features, exactly what a torch device's ridge rule sends (edge_agent/techniques/ridge.py),
once; later rounds an empty vector. A round message it already answered (a reconnect, the server's restart) is
answered again with the same uploads: the server drops duplicates. It leaves when the final round message comes.

What it does not do (a torch device does): training, prototypes, local evaluation, secure aggregation and privacy
noise (protofl/lite.py refuses those federations), a fleet's runs, a local checkpoint (its statistics are computed
again after a restart, and the server counts a device's statistics once).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import numpy as np

from edge_agent.core.client_data import ClientData
from edge_agent.inference.lite_backbone import LiteBackbone, renormalize_np
from edge_agent.ops.local_data import DataSpec, load_client_data
from edge_agent.ops.membership import Presence
from protofl import __version__, topics
from protofl.algorithms.ridge import ridge_length
from protofl.config import FederationConfig
from protofl.errors import ConfigError, WireError
from protofl.lite import lite_needs, lite_refusal
from protofl.plan import Phase, RoundPlan, Upload
from protofl.sparse import SparseVector
from protofl.transport.broker_url import BrokerOptions
from protofl.transport.mqtt import MqttTransport
from protofl.wire import (
    Config,
    Envelope,
    Join,
    Message,
    ParamsUpload,
    PublicSet,
    RoundStart,
    Status,
    decode_message,
    encode_message,
)

__all__ = ["LiteOptions", "LiteRunner"]

log = logging.getLogger("protofl.edge")
SERVER_UP = ("waiting", "running")


@dataclass(frozen=True)
class LiteOptions:
    profile: str = ""
    protocol: str = "auto"
    connect_timeout: float = 30.0
    threads: int | None = None  # onnxruntime's intra-op threads (default: its choice)


class LiteRunner:
    """One lite device in a federation until it finishes (`run`); `statistics` is what it sent."""

    def __init__(
        self, broker: BrokerOptions, fed: str, client_id: str, data: DataSpec, opts: LiteOptions = LiteOptions()
    ) -> None:
        self.fed, self.client_id, self.data_spec, self.opts = fed, client_id, data, opts
        self.presence = Presence(fed, client_id)
        self.transport = MqttTransport(
            broker,
            client_id,
            will=self.presence.will(),
            deliver="pump",
            protocol=opts.protocol,  # type: ignore[arg-type]
        )
        self.cfg: FederationConfig | None = None
        self.plan: RoundPlan | None = None
        self.data: ClientData | None = None
        self.public: PublicSet | None = None
        self.backbone: LiteBackbone | None = None
        self.statistics: np.ndarray | None = None
        self.sent_in: int | None = None  # the round whose training phase carried the statistics
        self.server_state = ""
        self.joined = False
        self.finished = False
        self.fatal: BaseException | None = None
        self._public_subscribed = False
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def run(self, timeout: float | None = None) -> LiteRunner:
        self.transport.connect(self.opts.connect_timeout)
        self._presence("online", self.opts.profile)
        self.transport.subscribe(topics.config(self.fed), self._on_config)
        self.transport.subscribe(topics.server_status(self.fed), self._on_status)
        self.transport.subscribe(topics.down(self.fed, self.client_id), self._on_down)
        end = None if timeout is None else time.monotonic() + timeout
        try:
            while not self._stop.is_set() and self.fatal is None and not self.finished:
                self.transport.pump(0.5)
                if end is not None and time.monotonic() > end:
                    break
            if self.finished:
                log.info("%s: federation finished (a lite device: its ridge statistics sent)", self.client_id)
                self._presence("offline", "finished")
        finally:
            self.transport.close()
        if self.fatal is not None:
            raise self.fatal
        return self

    # -- messages -----------------------------------------------------------------------------
    def _decode(self, payload: bytes, what: str) -> tuple[Envelope, Message] | None:
        try:
            return decode_message(payload)
        except WireError as exc:
            log.warning("%s: bad %s message: %s", self.client_id, what, exc)
            return None

    def _refuse(self, why: str) -> None:
        self._presence("online", f"{topics.CANNOT_JOIN} '{self.fed}': {why}")  # the server logs and counts it
        self.transport.flush(2.0)
        self.fatal = ConfigError(f"this lite device cannot join federation '{self.fed}': {why}")

    def _on_config(self, topic: str, payload: bytes) -> None:
        got = self._decode(payload, "config") if payload else None
        if got is None or not isinstance(got[1], Config) or self.cfg is not None:
            return
        msg = got[1]
        try:
            cfg = FederationConfig.from_dict(dict(msg.params))
        except ConfigError as exc:
            self._refuse(f"its config does not load here: {exc}")
            return
        why = lite_refusal(cfg, has_graph=True)  # the graph is checked when the public message comes
        if why is not None:
            self._refuse(why)
            return
        try:
            self.data = load_client_data(self.data_spec, cfg, self.client_id)
        except ConfigError as exc:
            self.fatal = exc
            return
        self.cfg, self.plan = cfg, RoundPlan.from_config(cfg)
        log.info(
            "%s: federation '%s' (%s); a lite device with %d samples", self.client_id, self.fed, cfg.preset,
            len(self.data.y_train),
        )  # fmt: skip
        self._maybe_subscribe_public()

    def _on_down(self, topic: str, payload: bytes) -> None:
        """The server's word to this device alone: a refused join ends the run (a re-send request is answered by the
        next round message: the statistics are sent again with it)."""
        got = self._decode(payload, "server request") if payload else None
        if got is not None and isinstance(got[1], Status) and got[1].state == "refused":
            self.fatal = ConfigError(f"the server refused this lite device: {got[1].detail}")

    def _on_status(self, topic: str, payload: bytes) -> None:
        got = self._decode(payload, "server status") if payload else None
        if got is None or not isinstance(got[1], Status):
            return
        state = got[1].state
        if state in SERVER_UP and self.server_state not in SERVER_UP and self.public is not None:
            self.joined = False  # the server came (back): join again
            self._join()
        self.server_state = state
        self._maybe_subscribe_public()

    def _maybe_subscribe_public(self) -> None:
        if self.cfg is not None and self.server_state in SERVER_UP and not self._public_subscribed:
            self._public_subscribed = True
            self.transport.subscribe(topics.public(self.fed), self._on_public)

    def _on_public(self, topic: str, payload: bytes) -> None:
        got = self._decode(payload, "public") if payload else None
        if got is None or not isinstance(got[1], PublicSet) or self.cfg is None:
            return
        msg = got[1]
        if msg.backbone is None or msg.graph is None or msg.layout is None:
            why = lite_refusal(self.cfg, has_graph=False)
            self._refuse(why or "the server ships no shared backbone")
            return
        try:
            backbone = LiteBackbone(msg.graph, msg.layout, self.opts.threads)
            backbone.load(msg.backbone)
        except ConfigError as exc:
            self._refuse(str(exc))
            return
        first = self.public is None
        self.public, self.backbone = msg, backbone
        if first:
            self._join()
            self.transport.subscribe(topics.round_(self.fed), self._on_round)

    def _join(self) -> None:
        if self.joined or self.cfg is None or self.data is None:
            return
        join = Join(
            arch="",
            n_samples=len(self.data.y_train),
            profile=self.opts.profile,
            agent_version=__version__,
            trains=False,
        )
        self._send(join, 0, "")
        self.joined = True

    def _on_round(self, topic: str, payload: bytes) -> None:
        got = self._decode(payload, "round") if payload else None
        if got is None or not isinstance(got[1], RoundStart) or self.plan is None:
            return
        env, msg = got[0], got[1]
        assert isinstance(msg, RoundStart)
        round_, phase = env.round, env.phase
        if phase == Phase.DONE.value or msg.final:
            self.finished = True
            return
        if Upload.ADAPTER not in lite_needs(self.plan, Phase(phase)):
            return  # a phase a lite device takes no part in
        self._send(self._upload(round_), round_, phase)
        log.info("%s: round %d: %s", self.client_id, round_, "statistics sent" if self.sent_in == round_ else "done")

    def _upload(self, round_: int) -> ParamsUpload:
        """The training phase's parameter vector: the ridge statistics in the first round it trains (and again for that
        round), an empty vector later (edge_agent/techniques/ridge.py's rule)."""
        assert self.cfg is not None and self.data is not None
        n = len(self.data.y_train)
        if self.sent_in is not None and round_ != self.sent_in:
            empty = SparseVector(
                ridge_length(self.cfg.proto_dim, self.cfg.num_classes), np.zeros(0, np.int64), np.zeros(0, np.float32)
            )
            return ParamsUpload(update=empty, n_samples=n, base_round=round_, dt="f4")
        if self.statistics is None:
            self.statistics = self.ridge_statistics()
        self.sent_in = round_
        return ParamsUpload(update=self.statistics, n_samples=n, base_round=round_, dt="f4")

    def ridge_statistics(self) -> np.ndarray:
        """protofl/algorithms/ridge.ridge_statistics of this device's features, summed a batch of rows at a time (the
        same float64 sums in another order: the features are never held whole, nor their float64 copy)."""
        assert self.cfg is not None and self.data is not None
        y, c = np.asarray(self.data.y_train, np.int64), self.cfg.num_classes
        g = b = None
        step = 256
        for i in range(0, len(y), step):
            h = self.features(slice(i, i + step)).astype(np.float64)
            ha = np.empty((len(h), h.shape[1] + 1))
            ha[:, :-1], ha[:, -1] = h, 1.0
            onehot = np.zeros((len(h), c))
            onehot[np.arange(len(h)), y[i : i + step]] = 1.0
            g = ha.T @ ha if g is None else g + ha.T @ ha
            b = ha.T @ onehot if b is None else b + ha.T @ onehot
        assert g is not None and b is not None
        d1 = g.shape[0]
        vec = np.concatenate([g[np.triu_indices(d1)], b.ravel()]).astype(np.float32)
        if vec.shape != (ridge_length(self.cfg.proto_dim, c),):
            raise ConfigError(
                f"the backbone's features are {d1 - 1}-dimensional; the federation's are {self.cfg.proto_dim}"
            )
        return vec

    def features(self, rows: slice = slice(None)) -> np.ndarray:
        """The backbone's features of this device's training data, its inputs normalised as the backbone's were."""
        assert self.backbone is not None and self.data is not None and self.public is not None
        own = (tuple(self.data.mean), tuple(self.data.std))
        to = self.public.norm
        x = self.data.x_train
        start, stop, _ = rows.indices(len(x))

        class _Rows:  # the training rows, renormalised a batch at a time
            def __len__(self) -> int:
                return stop - start

            def __getitem__(self, idx: slice) -> np.ndarray:
                i, j, _ = idx.indices(stop - start)
                return renormalize_np(np.asarray(x[start + i : start + j], np.float32), own, to)

        return self.backbone.embed(_Rows())  # type: ignore[arg-type]

    def _send(self, msg: Join | ParamsUpload, round_: int, phase: str) -> None:
        payload = encode_message(msg, fed=self.fed, sender=self.client_id, round=round_, phase=phase)
        self.transport.publish(topics.up(self.fed, self.client_id), payload)

    def _presence(self, state: str, detail: str = "") -> None:
        self.transport.publish(self.presence.topic, self.presence.payload(state, detail), retain=True)
