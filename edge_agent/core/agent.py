"""The edge agent: one device's side of a round, as inputs -> outcomes, with no transport inside.

Its inputs are what the server publishes - the retained `config`, `public` and `round` messages - a re-send
request from the server, and "join now"; each returns an `Outcome` (edge_agent/core/outcome.py): the uploads to send
on `up/{client_id}` with their round and phase, whether the checkpointed state changed, a failed round and
why, the inputs it refused, its deployable artifacts of the moment. The device mirrors the server's round
machine, which returns effects the I/O shell carries out: here the MQTT runner (edge_agent/ops/runner.py) or the
simulator's carrier (edge_agent/ops/local.py) carries the outcome out, and the same object runs under both.
Nothing here names a technique: what to send in each phase comes from the round plan (protofl.plan), how from
the active techniques' device rules (edge_agent/techniques). A training round is one pass: round message ->
targets -> objective -> local training -> uploads (+ metrics) -> outcome. Everything the federation's config decides
is one object read from it (edge_agent/core/device_config.py), replaced whole by a new config: its rules, which of the
model's parameters it shares (edge_agent/training/param_federation.py), and the sealing stages an upload passes after
training, as plain values, on its way to the wire (edge_agent/core/sealing.py: privacy noise, then masking).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from edge_agent.core import frozen, guard, memory
from edge_agent.core.artifacts import DeviceArtifacts, collect_device_artifacts
from edge_agent.core.client_data import ClientData, stable_seed
from edge_agent.core.device_config import DeviceConfig, read_config
from edge_agent.core.devices import resolve_device
from edge_agent.core.emulation import RoundClock
from edge_agent.core.evaluation import round_metrics
from edge_agent.core.outcome import Drop, Failure, Outcome, Send
from edge_agent.core.sealing import Outgoing
from edge_agent.core.uploads import plain_values, train_uploads
from edge_agent.inference.extractor import Extractor, make_extractor
from edge_agent.techniques import DeviceContext, DeviceRule, Objective, make_objective
from edge_agent.training import params as model_params
from edge_agent.training import trainer
from edge_agent.training.models import ProtoNet, build_model
from protofl import privacy, topics
from protofl.config import FederationConfig
from protofl.data.dataset import Images
from protofl.data.own import SKIPPED_KEY
from protofl.errors import ConfigError, WireError
from protofl.names import check_extractor
from protofl.plan import Phase, RoundPlan
from protofl.schedule import check_cadence, is_due, scores_test_set
from protofl.technique import first_answer
from protofl.traits import Traits
from protofl.wire import (
    DEFAULT_LIMITS,
    Config,
    Envelope,
    Join,
    Limits,
    Message,
    Metrics,
    ProtoSet,
    PublicSet,
    RoundStart,
    decode_message,
    encode_message,
    read_header,
)

log = logging.getLogger("protofl.edge")
AGENT_VERSION = "0.1.0"
KEPT_METRICS = 2  # rounds whose metrics a device keeps to send again: a round's line waits for its metrics only
# When a device keeps its deployable artifacts (edge_agent/core/artifacts.py): once it holds the federation's state,
# before its first local training (a device that joins late can predict from then on), and when the federation
# finishes.
ArtifactMoment = Literal["first_training", "final"]


@dataclass(frozen=True)
class PublicData:
    """What the server's public message gave this device: the public set, normalised as this device's data is (None
    where the federation uses none), the federation's shared backbone and the normalisation its inputs take."""

    x: torch.Tensor | None = None
    y: np.ndarray | None = None
    backbone: np.ndarray | None = None
    backbone_norm: tuple[list[float], list[float]] | None = None


@dataclass
class AgentStats:
    rounds_trained: int = 0
    uploaded_bytes: int = 0
    received_bytes: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    failed_rounds: int = 0


@dataclass
class _Step:
    """What the input being handled has made the agent do so far (becomes its `Outcome`)."""

    sends: list[Send] = field(default_factory=list)
    drops: list[Drop] = field(default_factory=list)
    failure: Failure | None = None
    left: Failure | None = None
    artifacts: DeviceArtifacts | None = None
    configured: bool = False
    finished: bool = False

    def outcome(self, changed: bool = False, trained: bool = False) -> Outcome:
        return Outcome(
            sends=tuple(self.sends),
            drops=tuple(self.drops),
            failure=self.failure,
            left=self.left,
            artifacts=self.artifacts,
            configured=self.configured,
            finished=self.finished,
            changed=changed,
            trained=trained,
        )


class EdgeAgent:
    """One device of a federation: inputs in, `Outcome`s out (module docstring).

    `clock`: a device profile's round clock (edge_agent/core/emulation.py): the upload budget, and when uploads may
    leave after the emulated compute. `resends`: keep the uploads sent for the last round message and the last
    rounds' metrics, and send them again when that round message comes again or the server asks (a runner over
    a broker that may lose them; the in-process simulator loses nothing). `artifacts_at`: the moments whose
    deployable artifacts the outcomes carry."""

    def __init__(
        self,
        client_id: str,
        fed: str,
        data: ClientData,
        *,
        arch: str | None = None,
        profile: str = "",
        traits: Traits | None = None,
        device: str = "cpu",
        eval_every: int = 1,
        test_every: int | None = None,
        extractor: str = "torch",
        clock: RoundClock | None = None,
        resends: bool = False,
        artifacts_at: Collection[ArtifactMoment] = (),
    ) -> None:
        self.client_id = client_id
        self.fed = fed
        self.data = data
        self.arch = arch
        self.profile = profile
        self.traits = traits  # what the join says this device is (link, tags, power: protofl/traits.py)
        self.device = torch.device(resolve_device(device))
        self.eval_every = max(1, eval_every)
        self.test_every = check_cadence(self.eval_every, test_every)  # None: the last round only
        self.extractor = check_extractor(extractor)  # what computes z for prototypes and metrics
        self.stats = AgentStats()
        self.limits: Limits = DEFAULT_LIMITS  # until the config says how large this federation's messages get
        # This federation as this device sees it (edge_agent/core/device_config.py): its options, plan, rules, way of
        # sharing parameters and the sealing stages of its uploads; replaced whole by a new config.
        self.config: DeviceConfig | None = None
        self.model: ProtoNet | None = None
        # What the sealing stages draw their noise from (the OS's entropy: edge_agent/core/sealing.py).
        self._noise = privacy.device_rng()
        self.public = PublicData()  # what the server's public message gave (none yet)
        self.global_head: tuple[np.ndarray, np.ndarray] | None = None  # its global head (the final round message's)
        self.global_adapter: np.ndarray | None = None
        self.adapter_round = -1  # the round whose global adapter we hold
        self.objective = Objective()  # this round's objective (also what the metrics classify with)
        self.handled: set[tuple[int, str]] = set()
        self.finished = False
        self.clock = clock
        self.resends = resends
        self.artifacts_at = frozenset(artifacts_at)
        # With `resends`: the last round message given (its round and phase) and the uploads sent for it, and
        # the metrics sent for the last KEPT_METRICS rounds. The first two are checkpointed (edge_agent/ops/resume.py).
        self.last_key: tuple[int, str] | None = None
        self.sent: tuple[Send, ...] = ()
        self.kept_metrics: dict[int, Send] = {}
        self._step: _Step | None = None
        self._extractor: Extractor | None = None
        # The training split's features after this round's training, where the uploads computed them: the
        # evaluation that follows in the same round reuses them (the model has not changed in between).
        self._z_train: np.ndarray | None = None
        # cfg.keep_optimizer: the momentum buffers the last round's local training left (PFLlib keeps one
        # optimiser per client for the whole run). Not checkpointed: a restarted device starts them afresh.
        self._momentum: trainer.Momentum = {}
        self.metrics_extra: dict[str, float] = {}  # sent in `Metrics.extra` (the clock's timings, the upload choice)
        self._frozen = frozen.FrozenBackbone()  # backbone = "frozen": cached h for the local data
        # uint8 images stay so (normalised per batch); normalised arrays become a tensor on the device, as before.
        self._x: trainer.Inputs = (
            data.x_train
            if isinstance(data.x_train, Images)
            else torch.from_numpy(np.ascontiguousarray(data.x_train, dtype=np.float32)).to(self.device)
        )
        self._y = torch.from_numpy(np.asarray(data.y_train, dtype=np.int64)).to(self.device)

    @property
    def cfg(self) -> FederationConfig | None:
        return None if self.config is None else self.config.cfg

    @property
    def plan(self) -> RoundPlan | None:
        return None if self.config is None else self.config.plan

    @property
    def rules(self) -> tuple[DeviceRule, ...]:
        """The active techniques' device halves, in rule order (none before a config)."""
        return () if self.config is None else self.config.rules

    @property
    def backbone(self) -> np.ndarray | None:
        """The federation's shared backbone (the public message's)."""
        return self.public.backbone

    @property
    def backbone_norm(self) -> tuple[list[float], list[float]] | None:
        """The normalisation the shared backbone's inputs take."""
        return self.public.backbone_norm

    @property
    def targets_table(self) -> dict[int, np.ndarray]:
        """This round's dense targets (empty before any)."""
        return self.objective.table()

    # -- inputs -> outcomes ---------------------------------------------------------------------
    @contextlib.contextmanager
    def _input(self) -> Iterator[_Step]:
        """One input being handled: what it does is collected in a `_Step` (an input within an input, e.g. a
        round message within `receive`, adds to the outer one's)."""
        if self._step is not None:
            yield self._step
            return
        self._step = _Step()
        try:
            yield self._step
        finally:
            self._step = None

    def join(self) -> Outcome:
        """Join the federation: the carrier sends it once the server is up (and again when the server asks)."""
        with self._input() as step:
            self._send(
                Join(
                    arch=self.arch or "",
                    n_samples=len(self.data.y_train),
                    profile=self.profile,
                    agent_version=AGENT_VERSION,
                    traits=self.traits,
                ),
                round_=0,
                phase="",
            )
            return step.outcome()

    def receive(self, topic: str, payload: bytes, *, recv_t: float | None = None) -> Outcome:
        """A message from the server's topics (`config`, `public`, `round`) as it arrived; `recv_t`: when it came
        off the wire (epoch s; the round clock measures compute from then)."""
        with self._input() as step:
            try:
                env, msg = decode_message(payload, limits=self.limits)
            except WireError as exc:
                self.stats.received_bytes += len(payload)
                if topic == topics.round_(self.fed):
                    self._round_arrived(None, recv_t)
                self._drop("malformed", f"{topic}: {exc}")
                return step.outcome()
            return self.handle(topic, env, msg, len(payload), recv_t=recv_t)

    def handle(
        self,
        topic: str,
        env: Envelope,
        msg: Message,
        nbytes: int,
        *,
        recv_t: float | None = None,
        config: DeviceConfig | None = None,
    ) -> Outcome:
        """A decoded message from the server. `config`: what `read_config` read from this Config message already
        (the runner reads the first config itself: the device's data depends on it)."""
        with self._input() as step:
            if topic == topics.round_(self.fed):
                key = (env.round, env.phase)
                if self.resends and key == self.last_key and key in self.handled:
                    # The round message came again: after a reconnect of ours or the server's, or a broker restart.
                    # Uploads sent while the server was not subscribed are lost, and it would wait for them
                    # forever, so they go again; the aggregator drops (and counts) the duplicates.
                    return self._again(self.sent, "announced again")
                self._round_arrived(key, recv_t, nbytes)
            self.stats.received_bytes += nbytes
            if env.fed != self.fed:
                self._drop("wrong_fed", f"message for federation '{env.fed}'")
                return step.outcome()
            handled = set(self.handled)
            trained = self.stats.rounds_trained
            if isinstance(msg, Config):
                self.on_config(msg, config)
            elif isinstance(msg, PublicSet):
                self.on_public(msg)
            elif isinstance(msg, RoundStart):
                self.on_round(env, msg)
            elif topic == topics.down(self.fed, self.client_id):
                self.on_step(env, msg)
            return step.outcome(
                changed=isinstance(msg, RoundStart) and self.handled != handled,
                trained=self.stats.rounds_trained != trained,
            )

    def resend(self, ask: str, round_: int, phase: str) -> Outcome:
        """The server asks again (edge_agent/ops/resend.py read and rate-limited its request) for what the broker may
        have dropped: our join, the uploads of round message (`round_`, `phase`), or round `round_`'s metrics.
        The same bytes go again; nothing if this device has not sent them (or does not keep them)."""
        if ask == "join":
            return self.join()
        if ask == "metrics":
            kept = self.kept_metrics.get(round_)
            return self._again(() if kept is None else (kept,), "asked again by the server")
        key = (round_, phase)
        if key != self.last_key or key not in self.handled:
            return Outcome()
        return self._again(self.sent, "asked again by the server")

    def restart(self) -> None:
        """The server waits for joins again, with no round opened: a fresh federation, whose round numbers start
        again at 1 (nothing handled yet)."""
        self.handled.clear()

    def deployable(self) -> DeviceArtifacts:
        """What this device could deploy now (it holds a model)."""
        return collect_device_artifacts(self)

    def _round_arrived(self, key: tuple[int, str] | None, recv_t: float | None, nbytes: int = 0) -> None:
        """A new round message (or an unreadable one) on the round topic: what is kept to send again starts
        afresh, and the round clock starts."""
        if self.resends:
            self.last_key, self.sent = key, ()
        if self.clock is not None:
            self.clock.begin(time.time() if recv_t is None else recv_t, nbytes, len(self.data.y_train))
            self.metrics_extra.clear()

    def _again(self, sends: tuple[Send, ...], why: str) -> Outcome:
        """`sends` once more, still not before their round's release time (a profile's emulated compute)."""
        release = (self.clock.release_t or 0.0) if self.clock is not None else 0.0
        return Outcome(
            sends=tuple(dataclasses.replace(s, not_before=release) for s in sends), resent=why if sends else ""
        )

    def _send(self, msg: Message, round_: int, phase: str, upload: bool = False) -> int:
        payload = encode_message(msg, fed=self.fed, sender=self.client_id, round=round_, phase=phase)
        release = 0.0
        if upload and self.clock is not None:
            release = self.clock.upload_release()  # the emulated compute is over: the uploads may leave
            self.metrics_extra.update(self.clock.extra)
        send = Send(topics.up(self.fed, self.client_id), payload, msg.KIND, round_, phase, release)
        if self.resends:
            if upload:
                self.sent += (send,)
            elif isinstance(msg, Metrics):
                self.kept_metrics[round_] = send
                for old in sorted(self.kept_metrics)[:-KEPT_METRICS]:
                    del self.kept_metrics[old]
        assert self._step is not None, "the agent sends only while it handles an input"
        self._step.sends.append(send)
        self.stats.uploaded_bytes += len(payload)
        return len(payload)

    def restore_sent(self, key: tuple[int, str] | None, payloads: list[tuple[str, bytes]]) -> None:
        """What a checkpoint says was sent for round message `key` (edge_agent/ops/resume.py)."""

        def kind(payload: bytes) -> str:
            try:
                return read_header(payload, self.limits).kind
            except WireError:
                return ""

        self.last_key = key
        self.sent = tuple(Send(t, p, kind(p), *(key or (0, ""))) for t, p in payloads)

    def _drop(self, reason: str, detail: str) -> None:
        self.stats.dropped[reason] = self.stats.dropped.get(reason, 0) + 1
        log.warning("%s: dropped message (%s): %s", self.client_id, reason, detail)
        if self._step is not None:
            self._step.drops.append(Drop(reason, detail))

    # -- config and public set ----------------------------------------------------------------
    def on_config(self, msg: Config, read: DeviceConfig | None = None) -> None:
        """Adopt the federation's config (`read`: what `read_config` read from `msg` already)."""
        shape = tuple(self.data.x_train.shape[1:])
        try:
            read = read_config(msg, shape) if read is None else read.for_data(shape)
        except ConfigError as exc:
            # Keep the previous config and model: a hostile or mistaken config must not wedge this device.
            self._drop("bad_config", f"{exc}; keeping the previous config")
            return
        cfg = read.cfg
        if self.cfg == cfg and self.model is not None:
            return  # retained config re-delivered after a reconnect
        options: dict[str, Any] = {}
        for rule in read.rules:
            options.update(rule.model_options())
        arch = self.arch or cfg.archs[0]
        # Every device of an architecture starts from the same seeded weights, as in the papers'
        # reference code (PFLlib deep-copies one model per client). Backbones still diverge: they
        # are trained privately and never sent. Identical starts give the prototype spaces a common
        # origin, which cross-client anchor means need.
        model = build_model(
            arch, cfg.in_shape, cfg.num_classes, cfg.proto_dim, cfg.adapter_rank, seed=cfg.seed, **options
        ).to(self.device)
        problem = read.sharing.layout_problem(model, msg)
        if problem is not None:
            self._drop("bad_config", problem)
            return
        self.config, self.model = read, model
        self._momentum = {}
        self.objective = Objective()
        # This federation's largest messages: the round message carries what it shares (our full model, FedAvg,
        # or adapter); the server's stated limit may be larger still.
        own = read.sharing.limits(read.plan, model)
        stated = int(msg.limits.get("max_message_bytes", 0))
        self.limits = (
            own
            if stated <= own.max_message_bytes
            else Limits(
                max_message_bytes=stated, max_elements=own.max_elements, max_bin_len=max(own.max_bin_len, stated)
            )
        )
        self.handled.clear()
        memory.mark("model")
        if self._step is not None:
            self._step.configured = True

    def on_public(self, msg: PublicSet) -> None:
        """Keep the server's public set (normalised as this device's data is)."""
        x = msg.x.astype(np.float32)
        if msg.x.dtype == np.uint8:
            mean = np.asarray(self.data.mean, dtype=np.float32).reshape(1, -1, 1, 1)
            std = np.asarray(self.data.std, dtype=np.float32).reshape(1, -1, 1, 1)
            x = (x / 255.0 - mean) / std
        # A public message may carry only the shared backbone (a federation whose plan uses no public images).
        self.public = PublicData(
            torch.from_numpy(np.ascontiguousarray(x)).to(self.device) if len(msg.y) else None,
            np.asarray(msg.y, dtype=np.int64) if len(msg.y) else None,
            msg.backbone,
            msg.norm,
        )

    # -- rules ----------------------------------------------------------------------------------
    def context(self) -> DeviceContext:
        """What the rules may read this round."""
        assert self.config is not None and self.model is not None
        return DeviceContext(
            cfg=self.config.cfg,
            plan=self.config.plan,
            model=self.model,
            device=self.device,
            embed=self._get_extractor().embed,
            x=self._x,
            y=self.data.y_train,
            public_x=self.public.x,
            public_y=self.public.y,
            backbone=self.public.backbone,
            backbone_norm=self.public.backbone_norm,
            data_norm=(tuple(self.data.mean), tuple(self.data.std)),
            masks=self.config.masks,
        )

    def local_prototypes(
        self, z: np.ndarray, y: np.ndarray
    ) -> tuple[dict[int, np.ndarray], dict[int, int] | None] | None:
        """The prototypes of the rule that makes them (mean or unit prototypes), or None: the plain class means."""
        return first_answer(self.rules, lambda r: r.local_prototypes(z, y))

    def pack(self, protos: dict[int, np.ndarray], counts: dict[int, int] | None, role: str) -> ProtoSet:
        """A prototype table as it travels: each rule's encoding in turn, then the plan's width and dtype (the
        sealing stages, e.g. DP's noise, come after: `_upload`)."""
        assert self.plan is not None
        for rule in self.rules:
            protos, counts = rule.encode_table(protos, counts, role)
        return ProtoSet.from_table(protos, self.plan.proto_width, self.plan.proto_dtype, counts)

    def make_objective(self, table: dict[int, np.ndarray], fresh: bool = True) -> Objective:
        """The objective for a dense target table (empty: the round carries none): the classifier one rule
        owns (else the head's) plus every rule's loss terms (edge_agent.techniques.make_objective)."""
        return make_objective(self.rules, self.context(), table, fresh)

    # -- rounds ---------------------------------------------------------------------------------
    def on_round(self, env: Envelope, msg: RoundStart) -> None:
        """A round message: train (or a phase's own upload) once per round and phase, or the federation's end."""
        if msg.final:
            first = not self.finished
            self.finished = True
            self._rules_see(env, msg)
            if msg.predictor is not None:  # the federation's global predictor: kept beside this device's own model
                self.global_head = msg.predictor
            if first and self._step is not None:
                self._step.finished = True
                if self.model is not None and "final" in self.artifacts_at:
                    self._step.artifacts = self.deployable()
            return
        key = (env.round, env.phase)
        if key in self.handled or self.plan is None or self.model is None:
            return
        if not self._rules_see(env, msg):
            self.handled.add(key)
            return
        if msg.participants is not None and self.client_id not in msg.participants:
            return
        if msg.targets is not None:
            problem = guard.anchors_problem(msg.targets.values)
            if problem is not None:
                self.handled.add(key)  # the same message would be refused again: nothing to retry
                self._drop("bad_round", f"round {env.round} {env.phase}: {problem}; keeping the previous state")
                return
        self.handled.add(key)
        saved = self._snapshot()
        try:
            if msg.adapter is not None:
                self._load_global_adapter(msg.adapter, env.round)
            if env.phase == Phase.TRAIN.value:
                self._train_round(env.round, msg)
            elif env.phase in {p.value for p in self.plan.phases}:
                self._other_phase(Phase(env.phase), env.round)
        except (ArithmeticError, ValueError, RuntimeError) as exc:  # diverged, or bad data from the server
            # Back to the state before this round, and not "handled": the round can be tried again.
            self._restore(saved)
            self.handled.discard(key)
            self.stats.failed_rounds += 1
            if self._step is not None:
                self._step.failure = Failure(env.round, env.phase, f"{type(exc).__name__}: {exc}")
            self._drop(
                "round_failed",
                f"round {env.round} {env.phase}: {type(exc).__name__}: {exc}; "
                f"previous state restored, the round will be retried",
            )

    def _rules_see(self, env: Envelope, msg: RoundStart) -> bool:
        """Every rule sees the round message (e.g. the global model it carries) before anything trains on it; False
        (counted, the rules' state as it was) where one refuses it."""
        if self.plan is None or self.model is None or not self.rules:
            return True
        ctx = self.context()
        saved = [copy.deepcopy(rule.state()) for rule in self.rules]
        try:
            for rule in self.rules:
                rule.on_round(ctx, env.round, msg)
        except (ValueError, WireError) as exc:
            for rule, state in zip(self.rules, saved, strict=True):
                rule.load_state(state)
            self._drop("bad_round", f"round {env.round} {env.phase}: {exc}; keeping the previous state")
            return False
        return True

    def _snapshot(self) -> dict[str, Any]:
        """What handling a round changes: the model's weights and the round state kept between rounds."""
        assert self.model is not None
        return {
            "model": copy.deepcopy(self.model.state_dict()),
            **{
                k: copy.deepcopy(getattr(self, k))
                for k in ("global_adapter", "adapter_round", "objective", "_momentum")
            },
            "rules": [copy.deepcopy(rule.state()) for rule in self.rules],
        }

    def _restore(self, saved: dict[str, Any]) -> None:
        assert self.model is not None
        self.model.load_state_dict(saved.pop("model"))
        for rule, state in zip(self.rules, saved.pop("rules"), strict=True):
            rule.load_state(state)
        for k, v in saved.items():
            setattr(self, k, v)

    def _load_global_adapter(self, vector: np.ndarray, round_: int) -> None:
        assert self.model is not None
        model_params.load_adapter_vector(self.model, vector)
        self.global_adapter = np.array(vector, dtype=np.float32, copy=True)
        self.adapter_round = round_

    def _base_round(self, round_: int) -> int:
        """The round whose global parameters round `round_` trains from (-1: none held; another round than
        `round_`: we missed this round's, e.g. its adapter), as the federation's way of sharing says."""
        assert self.config is not None
        return self.config.sharing.base_round(self.adapter_round, round_)

    def _other_phase(self, phase: Phase, round_: int) -> None:
        """A phase before training (e.g. public-set prototypes): the rule that owns it builds the upload."""
        if self._base_round(round_) != round_:
            return  # we missed this round's adapter; prototypes from a stale adapter would mislead
        upload = self._phase_upload(phase)
        if upload is not None:
            self._upload(upload, round_, phase.value)

    def _upload(self, msg: Message, round_: int, phase: str) -> None:
        """An upload through the federation's sealing stages (edge_agent/core/sealing.py), in order, then the wire."""
        assert self.config is not None
        up = Outgoing(msg, self.fed, self.client_id, round_, phase)
        for stage in self.config.stages:
            up = stage.seal(up, self._noise)
        self._send(up.msg, round_, phase, upload=True)

    def _phase_upload(self, phase: Phase) -> Message | None:
        ctx = self.context()
        return first_answer(self.rules, lambda r: r.phase_upload(ctx, phase, self.pack))

    def round_uploads(self, round_: int) -> list[tuple[Phase, Message]]:
        """The uploads of round `round_` in every phase, built as a round builds them from the model as it is
        (no training), and not sent: what `protofl-edge models` sizes (edge_agent/ops/model_sizes.py). An adapter
        federation's device that holds no global adapter yet takes its own as the round's."""
        config, model = self.config, self.model
        assert config is not None and model is not None, "round_uploads needs the federation's config first"
        own = config.sharing.own_global(model) if self.global_adapter is None else None
        if own is not None:
            self._load_global_adapter(own, round_)
        plan = config.plan
        out: list[tuple[Phase, Message]] = []
        for phase in plan.phases:
            if phase is Phase.TRAIN:
                out += [(phase, m) for m in self._train_uploads(round_, float("inf"))]
            elif (upload := self._phase_upload(phase)) is not None:
                out.append((phase, upload))
        return out

    def _train_round(self, round_: int, msg: RoundStart) -> None:
        """One pass: targets -> objective -> local training -> uploads -> send (-> metrics)."""
        cfg, plan, model = self.cfg, self.plan, self.model
        assert cfg is not None and plan is not None and model is not None
        if msg.params is not None:
            model_params.load_full_vector(model, msg.params)
        base = self._base_round(round_)
        if base < 0:
            return  # never received a global adapter: nothing valid to train from
        if plan.two_phase and base != round_:
            # The adapter comes with the first phase; a device that (re)joined during the training
            # phase holds an older one, and its upload would be dropped as stale anyway.
            return
        try:
            self.objective = self.make_objective(self._targets(msg))
        except WireError as exc:
            self._drop("bad_round", str(exc))
            return
        if self.stats.rounds_trained == 0 and "first_training" in self.artifacts_at and self._step is not None:
            self._step.artifacts = self.deployable()  # the global state as received, before this device changes it
        seed = stable_seed(cfg.seed, self.client_id, round_)
        # Dropout draws from torch's global RNG: seed it per client and round so that training does not
        # depend on what else ran in this process (in-process vs MQTT parity).
        torch.manual_seed(seed)
        momentum = self._momentum if cfg.keep_optimizer else None
        if cfg.backbone == "frozen":
            h = self._frozen.features(model, self._x)
            stats = frozen.train_on_cached_features(model, h, self._y, cfg, self.objective, seed, momentum=momentum)
        else:
            stats = trainer.train_local(model, self._x, self._y, cfg, self.objective, seed=seed, momentum=momentum)
        memory.mark("training")
        self._z_train = None
        for upload in self._train_uploads(round_, msg.deadline, stats.seen):
            self._upload(upload, round_, Phase.TRAIN.value)
        memory.mark("uploads")
        self.stats.rounds_trained += 1
        if is_due(round_, self.eval_every, cfg.rounds):
            self._send(
                self._metrics(stats, with_test=scores_test_set(round_, self.test_every, cfg.rounds)),
                round_,
                Phase.TRAIN.value,
            )
            memory.mark("evaluation")
        self._z_train = None

    def on_step(self, env: Envelope, msg: Message) -> None:
        """A server message on this device's own topic: a step of a sealing stage's protocol, which that stage
        answers (the same answer if it came before)."""
        stages = self.config.stages if self.config is not None else ()
        answer = next((a for stage in stages if (a := stage.answer(env, msg)) is not None), None)
        if answer is None:
            self._drop("stale", f"{msg.KIND} for round {env.round}/{env.phase}: no step of it open here")
        elif answer.drop is not None:
            self._drop(answer.drop.reason, answer.drop.detail)
            if answer.leave and self._step is not None:
                self._step.left = Failure(env.round, env.phase, answer.drop.detail)
        elif answer.reply is not None:
            self._send(answer.reply, env.round, env.phase)

    def _targets(self, msg: RoundStart) -> dict[int, np.ndarray]:
        """The round message's targets as the dense table training uses (empty without any)."""
        plan = self.plan
        assert plan is not None
        if msg.targets is None or len(msg.targets.classes) == 0:
            return {}
        if msg.target_label != plan.target_label:
            raise WireError(
                f"targets labelled '{msg.target_label}', but this federation's plan sends '{plan.target_label}'"
            )
        table, _ = msg.targets.table()
        for rule in self.rules:
            table = rule.decode_targets(table)
        return table

    def _train_uploads(
        self, round_: int, deadline: float, seen: tuple[np.ndarray, np.ndarray] | None = None
    ) -> list[Message]:
        """This round's training-phase uploads, fitted to the upload budget where a device profile's clock sets one.

        `seen`: the features local training saw, and their labels (cfg.proto_source == "during"): the
        prototypes average those instead of the trained model's features of the training split."""
        config, ctx = self.config, self.context()
        assert config is not None

        def features() -> tuple[np.ndarray, np.ndarray]:
            if seen is not None:
                return seen
            self._z_train = ctx.embed(self._x)  # (the evaluation that follows reuses them)
            return self._z_train, self.data.y_train

        values = plain_values(config.rules, ctx, self.pack, features)
        budget = self.clock.budget(deadline) if self.clock is not None else None  # (a link profile's, in bytes)
        out, choice = train_uploads(
            config.plan,
            values,
            global_adapter=self.global_adapter,
            base_round=self._base_round(round_),
            n=config.samples_sent(len(self.data.y_train)),
            round_=round_,
            fed=self.fed,
            sender=self.client_id,
            budget=budget,
        )
        if choice is not None:
            self.metrics_extra.update(choice.as_extra())
            log.info(
                "%s: round %d upload budget %d B: %s%s, %d B%s",
                self.client_id,
                round_,
                budget,
                choice.dt,
                f" K={choice.k}" if choice.k is not None else "",
                choice.nbytes,
                "" if choice.fits else " (does not fit: may miss the deadline)",
            )
        return out

    # -- evaluation -----------------------------------------------------------------------------
    def _metrics(self, stats: trainer.TrainStats, with_test: bool = True) -> Metrics:
        """This round's metrics (edge_agent/core/evaluation.py). Where the whole model is federated, clients skip the
        test set: its global accuracy is the aggregated model's (scored by the simulator) and it has no ensemble."""
        assert self.config is not None and self.model is not None
        embed = self._get_extractor().embed
        return round_metrics(
            self.objective,
            self.model,
            embed,
            self.data,
            stats,
            num_classes=self.config.cfg.num_classes,
            masks=self.config.masks,
            with_test=with_test and self.config.sharing.scores_test_set,
            z_train=lambda: self._z_train if self._z_train is not None else embed(self._x),
            extra={**self.metrics_extra, **self._skipped_extra()},
        )

    def _skipped_extra(self) -> dict[str, float]:
        """The count of its data's files the loader skipped, for the server's `status` and metrics (none: nothing)."""
        n = self.data.skipped_files
        return {SKIPPED_KEY: float(n)} if n else {}

    def _get_extractor(self) -> Extractor:
        """The extractor for the current model (rebuilt when a new config replaced the model)."""
        assert self.cfg is not None and self.model is not None
        if self._extractor is None or self._extractor.model is not self.model:
            self._extractor = make_extractor(self.extractor, self.model, frozen_backbone=self.cfg.backbone == "frozen")
        return self._extractor
