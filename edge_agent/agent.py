"""The edge agent: one device's side of a round, over any `Transport`.

It reads the retained `config`, `public` and `round` messages, trains locally and publishes its
uploads on `up/{client_id}`. The same object runs in the in-process simulator and on a device over
MQTT; nothing here knows which.
"""

from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass, field

import numpy as np
import torch

from edge_agent import params as model_params
from edge_agent import frozen, trainer
from edge_agent.extractor import EXTRACTORS, Extractor, make_extractor
from edge_agent.models import ProtoNet, build_model
from protofl import topics
from protofl.algorithms import apud, cps, scaling
from protofl.algorithms.fedproto import local_prototypes
from protofl.algorithms.refine import normalize_rows
from protofl.config import FederationConfig
from protofl.errors import ConfigError, WireError
from protofl.transport import Transport
from protofl.wire import (AdapterUpload, Config, Envelope, Join, Metrics, ProtoSet, ProtoUpload, PublicSet,
                          RoundStart, decode_message, encode_message)

log = logging.getLogger("protofl.edge")
AGENT_VERSION = "0.1.0"


@dataclass
class ClientData:
    """A client's private data, already normalised float32 (n, c, h, w), plus evaluation splits.

    `x_global`/`y_global` (the official test set) exist only in simulation, for global and
    ensemble accuracy; a field device reports accuracy on its own held-out split only.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    x_global: np.ndarray | None = None
    y_global: np.ndarray | None = None
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)

    def __post_init__(self) -> None:
        if len(self.x_train) != len(self.y_train) or len(self.x_test) != len(self.y_test):
            raise ValueError("client data: x and y lengths differ")
        if len(self.x_train) == 0:
            raise ValueError("client data: no training samples")


@dataclass
class AgentStats:
    rounds_trained: int = 0
    uploaded_bytes: int = 0
    received_bytes: int = 0
    dropped: dict[str, int] = field(default_factory=dict)


def stable_seed(*parts: object) -> int:
    """A seed from strings/ints that is the same in every process (unlike hash())."""
    return zlib.crc32("/".join(str(p) for p in parts).encode()) & 0x7FFFFFFF


class EdgeAgent:
    def __init__(self, client_id: str, fed: str, transport: Transport, data: ClientData, *,
                 arch: str | None = None, profile: str = "", device: str = "cpu",
                 eval_every: int = 1, extractor: str = "torch") -> None:
        if extractor not in EXTRACTORS:
            raise ConfigError(f"extractor must be one of {', '.join(EXTRACTORS)}, got {extractor!r}")
        self.client_id = client_id
        self.fed = fed
        self.transport = transport
        self.data = data
        self.arch = arch
        self.profile = profile
        self.device = torch.device(device)
        self.eval_every = max(1, eval_every)
        self.stats = AgentStats()
        self.cfg: FederationConfig | None = None
        self.model: ProtoNet | None = None
        self.masks: np.ndarray | None = None
        self.public_x: torch.Tensor | None = None
        self.public_y: np.ndarray | None = None
        self.global_adapter: np.ndarray | None = None
        self.adapter_round = -1  # the round whose global adapter we hold
        self.unit_prototypes: torch.Tensor | None = None
        self.local_norms: dict[int, float] = {}
        self.handled: set[tuple[int, str]] = set()
        self.finished = False
        self.extractor = extractor  # "torch" | "onnx": what computes z for prototypes and metrics
        self._extractor: Extractor | None = None
        self._frozen = frozen.FrozenBackbone()  # backbone = "frozen": cached h for the local data
        self._x = torch.from_numpy(np.ascontiguousarray(data.x_train, dtype=np.float32)).to(self.device)
        self._y = torch.from_numpy(np.asarray(data.y_train, dtype=np.int64)).to(self.device)

    # -- transport glue -----------------------------------------------------------------------
    def start(self) -> None:
        self.transport.subscribe(topics.config(self.fed), self.on_message)
        self.transport.subscribe(topics.public(self.fed), self.on_message)
        self.transport.subscribe(topics.round_(self.fed), self.on_message)
        self.join()

    def join(self) -> None:
        self._send(Join(arch=self.arch or "", n_samples=len(self.data.y_train), profile=self.profile,
                        agent_version=AGENT_VERSION), round_=0, phase="")

    def _send(self, msg: object, round_: int, phase: str) -> int:
        payload = encode_message(msg, fed=self.fed, sender=self.client_id, round=round_, phase=phase)
        self.transport.publish(topics.up(self.fed, self.client_id), payload, qos=1)
        self.stats.uploaded_bytes += len(payload)
        return len(payload)

    def _drop(self, reason: str, detail: str) -> None:
        self.stats.dropped[reason] = self.stats.dropped.get(reason, 0) + 1
        log.warning("%s: dropped message (%s): %s", self.client_id, reason, detail)

    def on_message(self, topic: str, payload: bytes) -> None:
        self.stats.received_bytes += len(payload)
        try:
            env, msg = decode_message(payload)
        except WireError as exc:
            self._drop("malformed", f"{topic}: {exc}")
            return
        if env.fed != self.fed:
            self._drop("wrong_fed", f"message for federation '{env.fed}'")
            return
        if isinstance(msg, Config):
            self.on_config(msg)
        elif isinstance(msg, PublicSet):
            self.on_public(msg)
        elif isinstance(msg, RoundStart):
            self.on_round(env, msg)

    # -- config and public set ----------------------------------------------------------------
    def on_config(self, msg: Config) -> None:
        try:
            cfg = FederationConfig.from_dict(dict(msg.params))
        except (ConfigError, TypeError) as exc:
            self._drop("bad_config", str(exc))
            return
        if self.cfg == cfg and self.model is not None:
            return  # retained config re-delivered after a reconnect
        self.cfg = cfg
        arch = self.arch or cfg.archs[0]
        # Every device of an architecture starts from the same seeded weights, as in the papers'
        # reference code (PFLlib deep-copies one model per client). Backbones still diverge: they
        # are trained privately and never sent. Identical starts give the prototype spaces a common
        # origin, which ERPA's cross-client anchor means need.
        seed = cfg.seed
        self.model = build_model(arch, tuple(cfg.in_shape), cfg.num_classes, cfg.proto_dim,
                                 cfg.adapter_rank, projection=cfg.consensus, seed=seed).to(self.device)
        self.masks = msg.class_masks if cfg.cps else None
        if cfg.federate == "adapter":
            mine = [(n, tuple(s)) for n, s in model_params.adapter_layout(self.model)]
            theirs = [(n, tuple(s)) for n, s in msg.adapter_layout]
            if mine != theirs:
                self.model = None
                self._drop("bad_config", f"adapter layout mismatch: server {theirs[:2]}..., device {mine[:2]}...")
                return
        self.handled.clear()

    def on_public(self, msg: PublicSet) -> None:
        x = msg.x.astype(np.float32)
        if msg.x.dtype == np.uint8:
            mean = np.asarray(self.data.mean, dtype=np.float32).reshape(1, -1, 1, 1)
            std = np.asarray(self.data.std, dtype=np.float32).reshape(1, -1, 1, 1)
            x = (x / 255.0 - mean) / std
        self.public_x = torch.from_numpy(np.ascontiguousarray(x)).to(self.device)
        self.public_y = np.asarray(msg.y, dtype=np.int64)

    # -- rounds ---------------------------------------------------------------------------------
    def on_round(self, env: Envelope, msg: RoundStart) -> None:
        if msg.final:
            self.finished = True
            return
        key = (env.round, env.phase)
        if key in self.handled or self.cfg is None or self.model is None:
            return
        if msg.participants is not None and self.client_id not in msg.participants:
            return
        self.handled.add(key)
        if msg.adapter is not None:
            self._load_global_adapter(msg.adapter, env.round)
        if env.phase == "proto":
            self._prototype_phase(env.round)
        elif env.phase == "train":
            self._train_phase(env.round, msg)

    def _load_global_adapter(self, vector: np.ndarray, round_: int) -> None:
        model_params.load_adapter_vector(self.model, vector)
        self.global_adapter = np.array(vector, dtype=np.float32, copy=True)
        self.adapter_round = round_

    def _prototype_phase(self, round_: int) -> None:
        """ERPA phase 1 (RefProtoFL Alg. 3): public-set prototypes, local ones for uncovered classes."""
        cfg = self.cfg
        assert cfg is not None and self.model is not None
        if cfg.federate == "adapter" and self.adapter_round != round_:
            return  # we missed this round's adapter; anchors from a stale adapter would mislead
        public_classes = set(cfg.public_class_list)
        pub = None
        if public_classes and self.public_x is not None:
            z = self._get_extractor().embed(self.public_x)
            protos, _ = local_prototypes(z, self.public_y, cfg.num_classes)
            pub = self._protoset({c: p for c, p in protos.items() if c in public_classes}, None, scaled=False)
        z = self._get_extractor().embed(self._x)
        protos, counts = local_prototypes(z, self.data.y_train, cfg.num_classes)
        local = {c: p for c, p in protos.items() if c not in public_classes}
        self._remember_norms(local)
        loc = self._protoset(local, {c: counts[c] for c in local}, scaled=cfg.scaling)
        self._send(ProtoUpload(local=loc, public=pub, n_samples=len(self.data.y_train)), round_, "proto")

    def _protoset(self, protos: dict[int, np.ndarray], counts: dict[int, int] | None, scaled: bool) -> ProtoSet:
        """Pack a prototype table for the wire: optional scaling (n*p, counts hidden), then CPS."""
        cfg = self.cfg
        assert cfg is not None
        if scaled and counts is not None:
            protos, counts = scaling.scale_prototypes(protos, counts), None
        if self.masks is not None:
            protos = cps.compress_table(protos, self.masks)
        classes = sorted(protos)
        width = cfg.s if self.masks is not None else cfg.proto_dim
        values = (np.stack([protos[c] for c in classes]).astype(np.float32) if classes
                  else np.zeros((0, width), dtype=np.float32))
        cnt = None if counts is None else np.asarray([counts[c] for c in classes], dtype=np.int64)
        return ProtoSet(classes=np.asarray(classes, dtype=np.int64), values=values, counts=cnt, dt=cfg.proto_dtype)

    def _remember_norms(self, protos: dict[int, np.ndarray]) -> None:
        """Local prototype norms (on the class's CPS support) for mu = "auto"."""
        for c, p in protos.items():
            v = p[self.masks[c]] if self.masks is not None else p
            self.local_norms[c] = float(np.linalg.norm(v))

    def _targets(self, msg: RoundStart) -> trainer.Targets:
        cfg = self.cfg
        assert cfg is not None and self.model is not None
        if msg.anchors is None or len(msg.anchors.classes) == 0:
            return trainer.Targets()
        classes = [int(c) for c in msg.anchors.classes]
        table = {c: msg.anchors.values[i] for i, c in enumerate(classes)}
        if msg.anchor_kind == "unit":
            P = torch.from_numpy(normalize_rows(msg.anchors.values).astype(np.float32)).to(self.device)
            with torch.no_grad():  # FedPAGR anchoring: head rows := refined prototypes, bias 0
                self.model.head.weight.copy_(P)
                self.model.head.bias.zero_()
            self.unit_prototypes = P
            return trainer.Targets("pagr", P, torch.ones(cfg.num_classes, dtype=torch.bool, device=self.device))
        flags = set(msg.anchor_kind.split("+"))
        if "cps" in flags:
            if self.masks is None:
                raise WireError("anchors are CPS-compressed but this federation's config has no masks")
            table = cps.reconstruct_table(table, self.masks)
        if "scaled" in flags:
            public = set(cfg.public_class_list)
            scaled = {c: v for c, v in table.items() if c not in public}
            if cfg.mu == "auto":
                # Without any local prototype we hold none of these classes, so no sample of ours
                # would use their targets: drop them rather than guess a magnitude.
                scaled = scaling.auto_rescale(scaled, self.local_norms) if self.local_norms else {}
                table = {c: v for c, v in table.items() if c in public}
            else:
                scaled = scaling.apply_mu(scaled, float(cfg.mu))
            table.update(scaled)
        kind = "anchor" if cfg.erpa else "mse"
        t = trainer.Targets.from_table(kind, table, cfg.num_classes, cfg.proto_dim)
        return trainer.Targets(t.kind, t.values.to(self.device), t.present.to(self.device))

    def _train_phase(self, round_: int, msg: RoundStart) -> None:
        cfg = self.cfg
        assert cfg is not None and self.model is not None
        if msg.params is not None:
            model_params.load_full_vector(self.model, msg.params)
        if cfg.federate == "adapter" and self.adapter_round < 0:
            return  # never received a global adapter: nothing valid to train from
        if cfg.two_phase and cfg.federate == "adapter" and self.adapter_round != round_:
            # ERPA ships the adapter with the prototype phase; a device that (re)joined during the
            # training phase holds an older one, and its upload would be dropped as stale anyway.
            return
        try:
            targets = self._targets(msg)
        except WireError as exc:
            self._drop("bad_round", str(exc))
            return
        seed = stable_seed(cfg.seed, self.client_id, round_)
        # Dropout (FedPAGR's projection) draws from torch's global RNG: seed it per client and round so
        # that training does not depend on what else ran in this process (in-process vs MQTT parity).
        torch.manual_seed(seed)
        if cfg.backbone == "frozen":
            h = self._frozen.features(self.model, self._x)
            stats = frozen.train_on_cached_features(self.model, h, self._y, cfg, targets, seed)
        else:
            stats = trainer.train_local(self.model, self._x, self._y, cfg, targets, seed=seed)
        n = len(self.data.y_train)
        if cfg.federate == "full":
            self._send(AdapterUpload(update=model_params.full_vector(self.model), n_samples=n,
                                     base_round=round_, dt=cfg.adapter_dtype), round_, "train")
        elif cfg.federate == "adapter":
            theta = model_params.adapter_vector(self.model)
            update: object = theta
            if cfg.apud:
                d = theta.shape[0]
                k = (apud.budget_from_bytes(d, cfg.apud_budget_bytes) if cfg.apud_budget_bytes
                     else apud.topk_budget(d, cfg.apud_ratio))
                update = apud.select_topk(theta, self.global_adapter, k)
            self._send(AdapterUpload(update=update, n_samples=n, base_round=self.adapter_round,
                                     dt=cfg.adapter_dtype), round_, "train")
        if cfg.prototypes != "none" and not cfg.erpa:
            self._send(ProtoUpload(local=self._trained_prototypes(), public=None, n_samples=n), round_, "train")
        self.stats.rounds_trained += 1
        if round_ % self.eval_every == 0 or round_ >= cfg.rounds:
            self._send(self._metrics(stats), round_, "train")

    def _trained_prototypes(self) -> ProtoSet:
        cfg = self.cfg
        assert cfg is not None and self.model is not None
        z = self._get_extractor().embed(self._x)
        if cfg.prototypes == "unit":  # FedPAGR: p_kc = normalize(mean of z_hat)
            protos, _ = local_prototypes(normalize_rows(z), self.data.y_train, cfg.num_classes)
            return self._protoset({c: normalize_rows(p[None])[0] for c, p in protos.items()}, None, scaled=False)
        protos, counts = local_prototypes(z, self.data.y_train, cfg.num_classes)
        self._remember_norms(protos)
        return self._protoset(protos, counts, scaled=cfg.scaling)

    def _metrics(self, stats: trainer.TrainStats) -> Metrics:
        assert self.cfg is not None and self.model is not None
        P = self.unit_prototypes if self.cfg.consensus else None
        x_test = torch.from_numpy(np.ascontiguousarray(self.data.x_test, dtype=np.float32)).to(self.device)
        local = self._get_extractor().predict_proba(x_test, P, self.cfg.beta)
        correct_local = int((local.argmax(1) == self.data.y_test).sum()) if len(local) else 0
        probs, n_test, correct_test = None, 0, 0
        if self.data.x_global is not None and self.data.y_global is not None:
            xg = torch.from_numpy(np.ascontiguousarray(self.data.x_global, dtype=np.float32)).to(self.device)
            probs = self._get_extractor().predict_proba(xg, P, self.cfg.beta)
            n_test = len(self.data.y_global)
            correct_test = int((probs.argmax(1) == self.data.y_global).sum())
        return Metrics(n_local=len(self.data.y_test), correct_local=correct_local, n_test=n_test,
                       correct_test=correct_test, probs=probs, train_s=stats.seconds, loss=stats.loss, extra={})

    def _get_extractor(self) -> Extractor:
        """The extractor for the current model (rebuilt when a new config replaced the model)."""
        assert self.cfg is not None and self.model is not None
        if self._extractor is None or self._extractor.model is not self.model:
            self._extractor = make_extractor(self.extractor, self.model,
                                             frozen_backbone=self.cfg.backbone == "frozen")
        return self._extractor
