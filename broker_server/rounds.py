"""The round state machine: joins, phases, uploads and deadlines, with no transport (numpy only).

Round r: open -> [a first prototype phase -> targets] -> train phase -> fold into the server model, as
the round plan says; what each phase does is the active techniques' rules (broker_server/stages.py).
A phase closes when every expected client has sent what the plan asks of it in that
phase, or at its deadline (`tick()`), provided at least `min_clients` did.

The machine takes decoded messages and hands the messages it sends to a `publish` callback (the I/O
shell in shell.py encodes and routes them). Anything it refuses raises `Drop` with a reason
before any state changes; the shell is the one place that turns an exception into a counted drop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from broker_server.stages import PhaseRun, build_model
from protofl.adapter import adapter_layout, initial_adapter
from protofl.algorithms.robust import ClipPolicy
from protofl.config import FederationConfig
from protofl.humanize import human_bytes
from protofl.plan import Phase, RoundPlan, Upload
from protofl.wire import (
    Config,
    Envelope,
    Join,
    Message,
    Metrics,
    ParamsUpload,
    ProtoSet,
    ProtoUpload,
    PublicSet,
    RoundStart,
    Status,
)

log = logging.getLogger("protofl.server")

# publish(message, round, phase) -> encoded size in bytes
Publish = Callable[[Message, int, str], int]


class Drop(Exception):
    """An upload the machine refuses: counted under `reason`, logged with `detail`, state unchanged."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


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
class OpenPhase:
    phase: Phase
    expected: set[str]
    needs: tuple[Upload, ...]
    deadline: float
    received: dict[str, set[Upload]] = field(default_factory=dict)

    def complete(self, client: str) -> bool:
        return set(self.needs) <= self.received.get(client, set())

    def done_clients(self) -> list[str]:
        return sorted(c for c in self.received if self.complete(c))


# How long a device whose connection dropped (its last will) keeps its place in the open round: a flaky
# link that reconnects within it delivers its upload; a dead device stops holding up the round after it.
OFFLINE_GRACE_S = 5.0


class RoundMachine:
    def __init__(self, cfg: FederationConfig, publish: Publish, *, clock: Callable[[], float],
                 initial_params: np.ndarray | None = None, public: PublicSet | None = None,
                 expected_clients: Sequence[str] | None = None,
                 on_round_end: Callable[[RoundRecord], None] | None = None,
                 on_metrics: Callable[[str, int, Metrics, int], None] | None = None,
                 policy: ClipPolicy | None = None, offline_grace: float = OFFLINE_GRACE_S,
                 on_boundary: Callable[[], None] | None = None) -> None:
        self.cfg = cfg
        # Called at every phase boundary (a phase opened, or the federation finished) before the round
        # message goes out: the durable service checkpoints there (the accumulators are empty then).
        self.on_boundary = on_boundary
        self.offline_grace = offline_grace
        self.plan = RoundPlan.from_config(cfg)
        self.publish = publish
        self.clock = clock
        self.public = public if self.plan.public_classes else None
        self.expected_clients = sorted(expected_clients) if expected_clients else None
        self.on_round_end = on_round_end
        self.on_metrics = on_metrics
        self.model = build_model(cfg, self.plan, policy)  # uploads are clipped by default
        self.layout = (adapter_layout(cfg.proto_dim, cfg.adapter_rank, cfg.num_classes)
                       if cfg.federate == "adapter" else [])
        if self.layout:
            self.model.adapter = initial_adapter(self.layout, seed=cfg.seed)
        if cfg.federate == "full" and initial_params is not None:
            # Without an initial vector the devices start from the config seed's model (identical
            # everywhere); the simulator passes the vector so that round 1's downlink is counted.
            self.model.params = np.asarray(initial_params, np.float32)
        self.clients: dict[str, Join] = {}
        self.departed: dict[str, Join] = {}  # went offline (last will); back on presence "online" or a Join
        self.leaving: dict[str, float] = {}  # offline, still expected until this time (the grace period)
        self.round = 0
        self.phase: OpenPhase | None = None
        self.run: PhaseRun | None = None  # the open phase's folds
        self.records: list[RoundRecord] = []
        self.current = RoundRecord(round=1)
        self.finished = False
        self._welcome_bytes = 0  # config + public set: what a new device receives once

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, limits: dict[str, int]) -> None:
        self._welcome_bytes = self.publish(
            Config(preset=self.cfg.preset, params=self.cfg.to_dict(), adapter_layout=self.layout,
                   class_masks=self.model.masks, limits=limits), 0, "")
        if self.public is not None:
            self._welcome_bytes += self.publish(self.public, 0, "")
        self._status("waiting", f"0/{self.quorum} clients")

    @property
    def quorum(self) -> int:
        return len(self.expected_clients) if self.expected_clients else self.cfg.min_clients

    def _status(self, state: str, detail: str = "") -> None:
        self.publish(Status(state=state, detail=detail), self.round, "")

    # -- incoming (every refusal raises Drop before anything changes) -----------------------------
    def receive(self, env: Envelope, msg: Message, nbytes: int) -> None:
        if isinstance(msg, Join):
            self._on_join(env, msg, nbytes)
        elif isinstance(msg, Metrics):
            self._on_metrics(env, msg, nbytes)
        elif isinstance(msg, (ProtoUpload, ParamsUpload)):
            self._on_upload(env, msg, nbytes)
        else:
            raise Drop("unexpected_kind", f"'{env.kind}' from {env.sender}")

    def needs_journal(self, env: Envelope, msg: Message) -> bool:
        """Whether applying this message changes state that a restart must rebuild: an upload the open
        phase accepts, or a join that adds a client. Raises Drop (state unchanged) for an upload or join
        that `receive` would refuse, so that nothing refused is ever written to the journal."""
        if isinstance(msg, (ProtoUpload, ParamsUpload)):
            self._check_upload(env, msg)
            return True
        if isinstance(msg, Join):
            if self.expected_clients and env.sender not in self.expected_clients:
                raise Drop("unknown_client", f"'{env.sender}' is not in this federation's client list")
            return env.sender not in self.clients
        return False

    def _on_join(self, env: Envelope, msg: Join, nbytes: int) -> None:
        if self.expected_clients and env.sender not in self.expected_clients:
            raise Drop("unknown_client", f"'{env.sender}' is not in this federation's client list")
        new = env.sender not in self.clients
        self.departed.pop(env.sender, None)
        self.leaving.pop(env.sender, None)
        self.clients[env.sender] = msg
        self.current.uplink_bytes += nbytes
        if new:
            self.current.downlink_bytes += self._welcome_bytes
            log.info("client %s joined (%s, %d samples); %d/%d", env.sender, msg.arch or "default arch",
                     msg.n_samples, len(self.clients), self.quorum)
        if self.round == 0 and not self.finished and len(self.clients) >= self.quorum:
            self._open_round(1)
        elif self.phase is not None and new:
            self.phase.expected.add(env.sender)

    def leave(self, client: str, now: float | None = None) -> None:
        """`client` went offline (its last will, or it said so). After `offline_grace` seconds without coming
        back (see `tick`) it no longer holds up the open phase, which then closes if everyone left in it has
        sent everything; a link that reconnects within the grace keeps its place."""
        if self.finished or client not in self.clients:
            return
        if self.offline_grace > 0:
            self.leaving.setdefault(client, (self.clock() if now is None else now) + self.offline_grace)
            return
        self._depart(client)

    def _depart(self, client: str) -> None:
        self.leaving.pop(client, None)
        self.departed[client] = self.clients.pop(client)
        open_ = self.phase
        log.info("client %s left; %d client(s) remain", client, len(self.clients))
        if open_ is not None and not open_.complete(client):
            open_.expected.discard(client)
            if open_.expected and all(open_.complete(c) for c in open_.expected):
                self._close_phase("quorum")

    def come_back(self, client: str) -> None:
        """A device that left is online again (reconnected, same session): it is a client again."""
        if self.leaving.pop(client, None) is not None:
            return  # back within the grace: it never left
        if self.finished or client not in self.departed:
            return
        self.clients[client] = self.departed.pop(client)
        if self.phase is not None:
            self.phase.expected.add(client)
        log.info("client %s is back; %d client(s)", client, len(self.clients))

    def _on_metrics(self, env: Envelope, msg: Metrics, nbytes: int) -> None:
        if env.sender not in self.clients:
            raise Drop("unknown_client", f"metrics from '{env.sender}'")
        if self.on_metrics is not None:
            self.on_metrics(env.sender, env.round, msg, nbytes)

    def _check_upload(self, env: Envelope, msg: ProtoUpload | ParamsUpload) -> tuple[OpenPhase, Upload]:
        """Where an upload belongs; raises Drop if it belongs nowhere now."""
        if env.sender not in self.clients:
            raise Drop("unknown_client", f"'{env.sender}' sent {env.kind} without joining")
        open_ = self.phase
        now = f"now round {self.round}/{open_.phase.value if open_ else '-'}"
        if open_ is None or env.round < self.round:
            raise Drop("stale", f"{env.kind} for round {env.round}/{env.phase} from {env.sender}; {now}")
        if env.phase not in {p.value for p in self.plan.phases}:
            raise Drop("wrong_phase", f"{env.kind} for phase '{env.phase}', which this federation does not have")
        phase = Phase(env.phase)
        if env.round == self.round and self.plan.phases.index(phase) < self.plan.phases.index(open_.phase):
            raise Drop("stale", f"{env.kind} for round {env.round}/{env.phase} from {env.sender}; {now}")
        if env.round > self.round or phase is not open_.phase:
            raise Drop("wrong_phase", f"{env.kind} for round {env.round}/{env.phase}, {now}")
        kind = Upload(env.kind)
        if kind in open_.received.get(env.sender, set()):
            raise Drop("duplicate", f"second {env.kind} from {env.sender} in round {env.round}/{env.phase}")
        if kind not in open_.needs:
            raise Drop("wrong_phase", f"{env.kind} is not part of the {phase.value} phase")
        if isinstance(msg, ParamsUpload) and self.plan.federate == "adapter" and msg.base_round != self.round:
            raise Drop("stale", f"adapter trained from round {msg.base_round}'s adapter, now {self.round}")
        return open_, kind

    def _on_upload(self, env: Envelope, msg: ProtoUpload | ParamsUpload, nbytes: int) -> None:
        open_, kind = self._check_upload(env, msg)
        # The phase checks the whole upload before folding any of it: one that raises here leaves it
        # (and everything below) unchanged.
        assert self.run is not None
        self.run.add(kind, msg)
        open_.received[env.sender] = open_.received.get(env.sender, set()) | {kind}
        self.current.uplink_bytes += nbytes
        if all(open_.complete(c) for c in open_.expected):
            self._close_phase("quorum")

    # -- phases ---------------------------------------------------------------------------------
    def _open_round(self, r: int) -> None:
        self.round = r
        self.current.round = r
        self.current.started = self.clock()
        self._open_phase(self.plan.first_phase)

    def _round_message(self, phase: Phase, deadline: float) -> RoundStart:
        """The round message that opens `phase`: a pure function of the model, so that a restarted
        aggregator announces the same one."""
        model, plan = self.model, self.plan
        assert self.run is not None
        targets = self.run.round_targets()
        return RoundStart(deadline=deadline,
                          adapter=model.adapter if plan.adapter_phase is phase else None,
                          params=model.params if phase is Phase.TRAIN else None,
                          targets=targets, target_label=plan.target_label if targets is not None else "",
                          participants=None, final=False, dt=plan.adapter_dtype)

    def _open_phase(self, phase: Phase) -> None:
        plan = self.plan
        self.run = PhaseRun(self.model, phase)
        deadline = self.clock() + self.cfg.round_timeout
        msg = self._round_message(phase, deadline)
        self.phase = OpenPhase(phase, set(self.clients), plan.sends(phase), deadline)
        if self.on_boundary is not None:
            self.on_boundary()
        self._status("running", f"round {self.round}/{self.cfg.rounds} {phase.value}")
        nbytes = self.publish(msg, self.round, phase.value)
        self.current.downlink_bytes += nbytes * len(self.clients)

    def tick(self, now: float | None = None) -> None:
        """Let devices whose grace ran out leave; close the open phase if its deadline has passed (call
        periodically)."""
        now = self.clock() if now is None else now
        for client, until in sorted(self.leaving.items()):
            if now >= until and client in self.clients and not self.finished:
                self._depart(client)
        open_ = self.phase
        if open_ is None or self.finished:
            return
        if now < open_.deadline:
            return
        done = open_.done_clients()
        if len(done) >= self.cfg.min_clients:
            self._close_phase("deadline")
        else:
            log.warning("round %d %s: deadline passed with %d/%d clients (min %d); waiting another %.0fs",
                        self.round, open_.phase.value, len(done), len(open_.expected), self.cfg.min_clients,
                        self.cfg.round_timeout)
            open_.deadline = now + self.cfg.round_timeout

    def _close_phase(self, why: str) -> None:
        open_ = self.phase
        assert open_ is not None
        assert self.run is not None
        self.run.finish()
        self.run = None
        nxt = self.plan.next_phase(open_.phase)
        if nxt is not None:
            self._open_phase(nxt)
            return
        self.phase = None
        rec = self.current
        rec.clients = open_.done_clients()
        rec.ended = self.clock()
        rec.closed_by = why
        self.records.append(rec)
        log.info("round %d: %d/%d clients (%s), up %s, down %s", rec.round, len(rec.clients), len(open_.expected),
                 why, human_bytes(rec.uplink_bytes), human_bytes(rec.downlink_bytes))
        self.current = RoundRecord(round=rec.round + 1)
        if self.on_round_end is not None:
            self.on_round_end(rec)
        if rec.round >= self.cfg.rounds:
            self._finish()
        else:
            self._open_round(rec.round + 1)

    def _finish(self) -> None:
        self.finished = True
        if self.on_boundary is not None:
            self.on_boundary()
        self._announce_finish()

    def _announce_finish(self) -> None:
        self.publish(RoundStart(deadline=self.clock(), adapter=self.model.adapter, params=self.model.params,
                                targets=None, target_label="", participants=None, final=True,
                                dt=self.plan.adapter_dtype), self.round, Phase.DONE.value)
        self._status("finished", f"{self.round} rounds")

    # -- durability: the state at a phase boundary, and a restart from it ------------------------
    def snapshot(self) -> dict[str, Any]:
        """The machine's state as plain values and numpy arrays (no objects), taken at a phase boundary:
        the open phase has received nothing yet, so its accumulators are fresh and need not be saved."""
        open_ = self.phase
        if open_ is not None and open_.received:
            raise RuntimeError("snapshot() is taken at phase boundaries only (this phase has uploads)")
        m = self.model
        return {
            "cfg": self.cfg.to_dict(), "round": self.round, "finished": self.finished,
            "phase": None if open_ is None else {"phase": open_.phase.value, "expected": sorted(open_.expected),
                                                 "deadline": open_.deadline},
            "anchors": None if m.targets is None else {
                "classes": m.targets.classes, "values": m.targets.values, "counts": m.targets.counts,
                "dt": m.targets.dt},
            "model": {"adapter": m.adapter, "params": m.params, "unit": m.unit, "masks": m.masks,
                      "prototypes": [[int(c), v] for c, v in sorted(m.prototypes.items())],
                      "radii": dict(m.radii), "clipped": dict(m.clipped),
                      "rules": {name: rule.persist()
                                for name, rule in zip(self.plan.techniques, m.rules, strict=True)}},
            "clients": {c: asdict(j) for c, j in self.clients.items()},
            "departed": {c: asdict(j) for c, j in self.departed.items()},
            "leaving": dict(self.leaving),
            "records": [asdict(r) for r in self.records], "current": asdict(self.current),
            "welcome_bytes": self._welcome_bytes,
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Back to a `snapshot()` (the config must be the one it was taken with). The open phase gets a
        fresh deadline: its devices could not reach us while we were down."""
        if state["cfg"] != self.cfg.to_dict():
            changed = sorted(k for k in set(state["cfg"]) | set(self.cfg.to_dict())
                             if state["cfg"].get(k) != self.cfg.to_dict().get(k))
            raise ValueError(f"the saved federation was run with another config (differs in: {', '.join(changed)})")
        m = self.model
        sm = state["model"]
        m.adapter, m.params, m.unit, m.masks = sm["adapter"], sm["params"], sm["unit"], sm["masks"]
        m.prototypes = {int(c): v for c, v in sm["prototypes"]}
        m.radii, m.clipped = dict(sm["radii"]), dict(sm["clipped"])
        self.round, self.finished = int(state["round"]), bool(state["finished"])
        for name, rule in zip(self.plan.techniques, m.rules, strict=True):
            rule.restore(sm.get("rules", {}).get(name, {}))
        a = state["anchors"]
        m.targets = None if a is None else ProtoSet(classes=a["classes"], values=a["values"], counts=a["counts"],
                                                    dt=a["dt"])
        self.clients = {c: Join(**j) for c, j in state["clients"].items()}
        self.departed = {c: Join(**j) for c, j in state["departed"].items()}
        self.leaving = {c: float(t) for c, t in state["leaving"].items()}
        self.records = [RoundRecord(**r) for r in state["records"]]
        self.current = RoundRecord(**state["current"])
        self._welcome_bytes = int(state["welcome_bytes"])
        self.run = None
        self.phase = None
        p = state["phase"]
        if p is not None:
            phase = Phase(p["phase"])
            self.run = PhaseRun(m, phase)
            self.phase = OpenPhase(phase, set(p["expected"]), self.plan.sends(phase),
                                   self.clock() + self.cfg.round_timeout)

    def announce(self, limits: dict[str, int]) -> None:
        """After a restart: publish the retained messages again (config, public set, status, the open
        round message) without counting them as downlink; a device that already handled the round
        message sends its uploads again, and those already applied are dropped as duplicates."""
        self.publish(Config(preset=self.cfg.preset, params=self.cfg.to_dict(), adapter_layout=self.layout,
                            class_masks=self.model.masks, limits=limits), 0, "")
        if self.public is not None:
            self.publish(self.public, 0, "")
        if self.finished:
            self._announce_finish()
        elif self.phase is None:
            self._status("waiting", f"{len(self.clients)}/{self.quorum} clients")
        else:
            self._status("running", f"round {self.round}/{self.cfg.rounds} {self.phase.phase.value}")
            self.publish(self._round_message(self.phase.phase, self.phase.deadline), self.round, self.phase.phase.value)
