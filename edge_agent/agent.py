"""The edge agent: one device's side of a round, over any `Transport`.

It reads the retained `config`, `public` and `round` messages, trains locally and publishes its
uploads on `up/{client_id}`. The same object runs in the in-process simulator and on a device over
MQTT; nothing here knows which. What to send in each phase comes from the round plan (protofl.plan),
the client halves of the techniques from edge_agent/stages.py and protofl/algorithms; this class is
the glue: messages in, model and data through torch, messages out.
"""

from __future__ import annotations

import copy
import logging
import zlib
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from edge_agent import frozen, guard, stages, trainer
from edge_agent import params as model_params
from edge_agent.devices import resolve_device
from edge_agent.extractor import Extractor, class_probabilities, make_extractor
from edge_agent.models import ProtoNet, build_model
from edge_agent.uploads import train_uploads
from protofl import topics
from protofl.adapter import layout_size
from protofl.algorithms.cps import off_mask_energy
from protofl.algorithms.fedproto import nearest_prototype
from protofl.config import FederationConfig
from protofl.errors import ConfigError, WireError
from protofl.names import check_extractor
from protofl.plan import Phase, RoundPlan, TargetKind
from protofl.schedule import is_due
from protofl.transport import Transport
from protofl.wire import (DEFAULT_LIMITS, Config, Envelope, Join, Limits, Metrics, ProtoUpload,
                          PublicSet, RoundStart, decode_message, encode_message)

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
    failed_rounds: int = 0


def stable_seed(*parts: object) -> int:
    """A seed from strings/ints that is the same in every process (unlike hash())."""
    return zlib.crc32("/".join(str(p) for p in parts).encode()) & 0x7FFFFFFF


class EdgeAgent:
    def __init__(self, client_id: str, fed: str, transport: Transport, data: ClientData, *,
                 arch: str | None = None, profile: str = "", device: str = "cpu",
                 eval_every: int = 1, test_every: int | None = None, extractor: str = "torch") -> None:
        self.client_id = client_id
        self.fed = fed
        self.transport = transport
        self.data = data
        self.arch = arch
        self.profile = profile
        self.device = torch.device(resolve_device(device))
        self.eval_every = max(1, eval_every)
        self.test_every = max(1, test_every) if test_every is not None else self.eval_every
        self.extractor = check_extractor(extractor)  # what computes z for prototypes and metrics
        self.stats = AgentStats()
        self.limits: Limits = DEFAULT_LIMITS  # until the config says how large this federation's messages get
        self.cfg: FederationConfig | None = None
        self.plan: RoundPlan | None = None
        self.model: ProtoNet | None = None
        self.tables = stages.DeviceTables()
        self.public_x: torch.Tensor | None = None
        self.public_y: np.ndarray | None = None
        self.global_adapter: np.ndarray | None = None
        self.adapter_round = -1  # the round whose global adapter we hold
        self.targets_table: dict[int, np.ndarray] = {}  # this round's global prototypes, dense (for metrics)
        self.unit_prototypes: torch.Tensor | None = None
        self.handled: set[tuple[int, str]] = set()
        self.last_failure: tuple[int, str, str] | None = None  # (round, phase, why) of a round that failed here
        self.finished = False
        self._extractor: Extractor | None = None
        # Set by a runner with a link profile: deadline (server clock) -> upload budget in bytes.
        self.upload_budget: Callable[[float], int | None] | None = None
        self.metrics_extra: dict[str, float] = {}  # sent in `Metrics.extra` (the runner's timings)
        self._frozen = frozen.FrozenBackbone()  # backbone = "frozen": cached h for the local data
        self._x = torch.from_numpy(np.ascontiguousarray(data.x_train, dtype=np.float32)).to(self.device)
        self._y = torch.from_numpy(np.asarray(data.y_train, dtype=np.int64)).to(self.device)

    @property
    def local_norms(self) -> dict[int, float]:
        return self.tables.local_norms

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
            env, msg = decode_message(payload, limits=self.limits)
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
        problem = guard.config_problem(cfg, tuple(self.data.x_train.shape[1:]))
        if problem is not None:
            # Keep the previous config and model: a hostile or mistaken config must not wedge this device.
            self._drop("bad_config", f"{problem}; keeping the previous config")
            return
        plan = RoundPlan.from_config(cfg)
        arch = self.arch or cfg.archs[0]
        # Every device of an architecture starts from the same seeded weights, as in the papers'
        # reference code (PFLlib deep-copies one model per client). Backbones still diverge: they
        # are trained privately and never sent. Identical starts give the prototype spaces a common
        # origin, which ERPA's cross-client anchor means need.
        model = build_model(arch, tuple(cfg.in_shape), cfg.num_classes, cfg.proto_dim,
                            cfg.adapter_rank, projection=cfg.consensus, seed=cfg.seed).to(self.device)
        if cfg.federate == "adapter":
            mine = [(n, tuple(s)) for n, s in model_params.adapter_layout(model)]
            theirs = [(n, tuple(s)) for n, s in msg.adapter_layout]
            if mine != theirs:
                self._drop("bad_config", f"adapter layout mismatch: server {theirs[:2]}..., device {mine[:2]}...")
                return
        self.cfg, self.plan, self.model = cfg, plan, model
        self.tables = stages.DeviceTables(masks=msg.class_masks if plan.cps else None)
        # This federation's largest messages: the round message carries our full model (FedAvg) or
        # adapter; the server's stated limit may be larger still.
        own = self.plan.limits(layout_size(model_params.full_layout(self.model)) if cfg.federate == "full" else None,
                               layout_size(model_params.adapter_layout(self.model)))
        stated = int(msg.limits.get("max_message_bytes", 0))
        self.limits = own if stated <= own.max_message_bytes else Limits(
            max_message_bytes=stated, max_elements=own.max_elements, max_bin_len=max(own.max_bin_len, stated))
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
        if key in self.handled or self.plan is None or self.model is None:
            return
        if msg.participants is not None and self.client_id not in msg.participants:
            return
        if msg.anchors is not None:
            problem = guard.anchors_problem(msg.anchors.values)
            if problem is not None:
                self.handled.add(key)  # the same message would be refused again: nothing to retry
                self._drop("bad_round", f"round {env.round} {env.phase}: {problem}; keeping the previous state")
                return
        self.handled.add(key)
        saved = self._snapshot()
        try:
            if msg.adapter is not None:
                self._load_global_adapter(msg.adapter, env.round)
            if env.phase == Phase.PROTO.value:
                self._prototype_phase(env.round)
            elif env.phase == Phase.TRAIN.value:
                self._train_phase(env.round, msg)
        except (ArithmeticError, ValueError, RuntimeError) as exc:  # diverged, or bad data from the server
            # Back to the state before this round, and not "handled": the round can be tried again.
            self._restore(saved)
            self.handled.discard(key)
            self.stats.failed_rounds += 1
            self.last_failure = (env.round, env.phase, f"{type(exc).__name__}: {exc}")
            self._drop("round_failed", f"round {env.round} {env.phase}: {type(exc).__name__}: {exc}; "
                                       f"previous state restored, the round will be retried")
            return
        self.last_failure = None

    def _snapshot(self) -> dict[str, object]:
        """What handling a round changes: the model's weights and the round state kept between rounds."""
        assert self.model is not None
        return {"model": copy.deepcopy(self.model.state_dict()),
                **{k: copy.deepcopy(getattr(self, k)) for k in ("global_adapter", "adapter_round", "targets_table",
                                                                 "unit_prototypes", "tables")}}

    def _restore(self, saved: dict[str, object]) -> None:
        assert self.model is not None
        self.model.load_state_dict(saved.pop("model"))  # type: ignore[arg-type]
        for k, v in saved.items():
            setattr(self, k, v)

    def _load_global_adapter(self, vector: np.ndarray, round_: int) -> None:
        model_params.load_adapter_vector(self.model, vector)
        self.global_adapter = np.array(vector, dtype=np.float32, copy=True)
        self.adapter_round = round_

    def _holds_round_adapter(self, round_: int) -> bool:
        """Whether we hold the adapter this round's phases were opened with (adapter federation)."""
        assert self.plan is not None
        return self.plan.federate != "adapter" or self.adapter_round == round_

    def _prototype_phase(self, round_: int) -> None:
        """ERPA phase 1 (RefProtoFL Alg. 3): public-set prototypes, local ones for uncovered classes."""
        plan = self.plan
        assert plan is not None and self.model is not None
        if not self._holds_round_adapter(round_):
            return  # we missed this round's adapter; anchors from a stale adapter would mislead
        extractor = self._get_extractor()
        public, local = stages.erpa_tables(plan, self.tables, self._embed_public(), self.public_y,
                                           extractor.embed(self._x), self.data.y_train)
        self._send(ProtoUpload(local=local, public=public, n_samples=len(self.data.y_train)), round_, Phase.PROTO.value)

    def _embed_public(self) -> np.ndarray | None:
        """z of the public set (None when this federation has no public classes or we hold no public set)."""
        assert self.plan is not None
        if not self.plan.public_classes or self.public_x is None:
            return None
        return self._get_extractor().embed(self.public_x)

    def _targets(self, msg: RoundStart) -> trainer.Targets:
        """This round's training targets, from the round message's anchors and the plan."""
        plan = self.plan
        assert plan is not None and self.model is not None
        self.targets_table = {}
        if msg.anchors is None or len(msg.anchors.classes) == 0:
            return trainer.Targets()
        if plan.target is TargetKind.PAGR:
            P = torch.from_numpy(stages.pagr_prototypes(plan, self.tables, msg.anchors, msg.anchor_kind)).to(self.device)
            with torch.no_grad():  # FedPAGR anchoring: head rows := refined prototypes, bias 0
                self.model.head.weight.copy_(P)
                self.model.head.bias.zero_()
            self.unit_prototypes = P
            return trainer.Targets(TargetKind.PAGR, P, torch.ones(plan.num_classes, dtype=torch.bool, device=self.device))
        table = stages.alignment_targets(plan, self.tables, msg.anchors, msg.anchor_kind, self.cfg.mu)
        self.targets_table = table
        return trainer.Targets.from_table(plan.target, table, plan.num_classes, plan.proto_dim, self.device)

    def _train_phase(self, round_: int, msg: RoundStart) -> None:
        cfg, plan = self.cfg, self.plan
        assert cfg is not None and plan is not None and self.model is not None
        if msg.params is not None:
            model_params.load_full_vector(self.model, msg.params)
        if plan.federate == "adapter" and self.adapter_round < 0:
            return  # never received a global adapter: nothing valid to train from
        if plan.two_phase and not self._holds_round_adapter(round_):
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
        phase = Phase.TRAIN.value
        for upload in self._train_uploads(round_, n, msg.deadline):
            self._send(upload, round_, phase)
        self.stats.rounds_trained += 1
        if is_due(round_, self.eval_every, cfg.rounds):
            self._send(self._metrics(stats, with_test=is_due(round_, self.test_every, cfg.rounds)), round_, phase)

    def _train_uploads(self, round_: int, n: int, deadline: float) -> list[object]:
        """This round's training-phase uploads, fitted to `upload_budget` where a runner set one."""
        plan = self.plan
        assert self.cfg is not None and plan is not None and self.model is not None
        theta = model_params.full_vector(self.model) if plan.federate == "full" else \
            model_params.adapter_vector(self.model) if plan.federate == "adapter" else None
        extractor = self._get_extractor()
        local = stages.trained_prototypes(plan, self.tables, extractor.embed(self._x), self.data.y_train) \
            if plan.prototypes != "none" and not plan.two_phase else None
        public = stages.public_unit_prototypes(plan, self.tables, self._embed_public(), self.public_y) \
            if plan.public_in_train else None
        budget = self.upload_budget(deadline) if self.upload_budget is not None else None
        out, choice = train_uploads(plan, self.cfg, theta=theta, global_adapter=self.global_adapter,
                                    base_round=round_ if plan.federate == "full" else self.adapter_round, local=local,
                                    n=n, round_=round_, fed=self.fed, sender=self.client_id, budget=budget,
                                    public=public)
        if choice is not None:
            self.metrics_extra.update(choice.as_extra())
            log.info("%s: round %d upload budget %d B: %s%s, %d B%s", self.client_id, round_, budget, choice.dt,
                     f" K={choice.k}" if choice.k is not None else "", choice.nbytes,
                     "" if choice.fits else " (does not fit: may miss the deadline)")
        return out

    # -- evaluation -----------------------------------------------------------------------------
    def _metrics(self, stats: trainer.TrainStats, with_test: bool = True) -> Metrics:
        """The head's accuracy (FedPAGR: cosine to P) and the nearest-global-prototype accuracy on the
        local split and, in simulation and `with_test`, on the official test set (with the test set's
        class probabilities). One forward pass per split: both predictions come from the same z.

        FedAvg's clients skip the test set: its global accuracy is the aggregated model's (scored by the
        simulator) and it has no ensemble."""
        assert self.cfg is not None and self.model is not None
        P = self.unit_prototypes if self.cfg.consensus else None
        z_local = self._get_extractor().embed(self.data.x_test)
        local = class_probabilities(self.model, z_local, P, self.cfg.beta)
        correct_local = int((local.argmax(1) == self.data.y_test).sum()) if len(local) else 0
        proto_local = self._nearest_correct(z_local, self.data.y_test, local, P)
        extra = {}
        if self.tables.masks is not None and len(z_local):
            extra["off_mask_energy"] = off_mask_energy(z_local, self.data.y_test, self.tables.masks)
        probs, n_test, correct_test, proto_test = None, 0, 0, None
        if (with_test and self.cfg.federate != "full"
                and self.data.x_global is not None and self.data.y_global is not None):
            z_global = self._get_extractor().embed(self.data.x_global)
            probs = class_probabilities(self.model, z_global, P, self.cfg.beta)
            n_test = len(self.data.y_global)
            correct_test = int((probs.argmax(1) == self.data.y_global).sum())
            proto_test = self._nearest_correct(z_global, self.data.y_global, probs, P)
        return Metrics(n_local=len(self.data.y_test), correct_local=correct_local, n_test=n_test,
                       correct_test=correct_test, probs=probs, train_s=stats.seconds, loss=stats.loss,
                       extra={**self.metrics_extra, **extra},
                       proto_correct_local=proto_local, proto_correct_test=proto_test)

    def _nearest_correct(self, z: np.ndarray, y: np.ndarray, probs: np.ndarray,
                         P: torch.Tensor | None) -> int | None:
        """Correct predictions of the nearest global prototype; None without global prototypes.

        FedPAGR's probabilities are already softmax(cos(z, P) / beta), whose argmax is the nearest
        prototype by cosine. Elsewhere: L2 from z to this round's (dense) global prototypes.
        """
        if P is not None:
            return int((probs.argmax(1) == y).sum()) if len(probs) else 0
        if not self.targets_table:
            return None
        if len(y) == 0:
            return 0
        return int((nearest_prototype(z, self.targets_table) == y).sum())

    def _get_extractor(self) -> Extractor:
        """The extractor for the current model (rebuilt when a new config replaced the model)."""
        assert self.cfg is not None and self.model is not None
        if self._extractor is None or self._extractor.model is not self.model:
            self._extractor = make_extractor(self.extractor, self.model,
                                             frozen_backbone=self.cfg.backbone == "frozen")
        return self._extractor
