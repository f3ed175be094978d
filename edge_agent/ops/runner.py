"""The device loop: one `EdgeAgent` over MQTT for as long as the federation runs.

Order of events. Connect (last will: presence "offline"), announce presence "online", read the retained
`config` (the data is loaded only then: a partition depends on the federation's config), then wait for
the server's retained `server/status`. Only when the server is up does the device send `join` and
subscribe `public` and `round`: an upload can then never overtake its join, and a join is not lost on
a broker where nobody listens yet. The retained `round` message is how a device resumes after a
reconnect or restart; it carries the adapter, so a device that missed rounds gets all of it. When the
server comes back after "offline" / "stopped", the device joins again.

A config the device cannot afford is refused before any data is loaded for it (edge_agent/core/guard.py). A
round that fails locally (training diverged, hostile anchors) leaves the agent as it was before the
round; the device reports it on its presence topic and tries the round again after `RETRY_S`, up to
`MAX_ATTEMPTS` times.

Uploads are at-least-once: if a round message the agent already handled arrives again (our reconnect,
the server's, a broker restart), the uploads of that round are sent again, since the server may have
been unsubscribed when they first went out; the aggregator drops and counts the duplicates. The same
happens when the server asks this device on its `down/<id>` topic (edge_agent/ops/resend.py): the broker
dropped messages after acknowledging them, so the server asks whoever still owes the open phase to send
its uploads (or its join) again.

The agent publishes nothing itself (edge_agent/core/agent.py): each input the runner hands it - the join, the config,
the public set, a round message, a step of secure aggregation, a re-send request - comes back as an `Outcome`
(edge_agent/core/outcome.py), and every one is carried out by the same `Carrier.carry` as the simulator's
(edge_agent/ops/local.py): a local checkpoint first where the state changed (`--state-dir`: an upload never leaves
before the state that made it is on disk, so a restarted device cannot have sent work it no longer holds; a
checkpoint is loaded into the agent's first model), then the sends in order through the outbox (with a device
profile each not before the release time the agent's round clock gave it, edge_agent/ops/pace.py), the deployable
artifacts, a failed round on the presence topic with a retry planned, the log lines (a round's "uploaded" line only
once the broker acknowledged every message of it: a device cut off, or revoked while it trained, never says it
uploaded what the broker does not hold). What is not the loop itself
lives beside it: the presence and a fleet's runs (edge_agent/ops/membership.py), the outbox and the retries
(edge_agent/ops/pace.py), the checkpoint and the artifacts on disk (edge_agent/ops/resume.py).

All agent work runs on the runner's thread (`pump`), never on paho's network thread, so training
does not stall keepalives.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from edge_agent.core.agent import EdgeAgent
from edge_agent.core.artifacts import DeviceArtifacts
from edge_agent.core.device_config import DeviceConfig, read_config
from edge_agent.core.emulation import Emulation
from edge_agent.core.memory import MemoryLimit, mark
from edge_agent.core.outcome import Carrier, Failure, Outcome, Send
from edge_agent.ops.local_data import DataSpec, load_client_data
from edge_agent.ops.membership import FleetMember, Presence
from edge_agent.ops.pace import GAVE_UP, Outbox, Retry, Ticket
from edge_agent.ops.resend import ResendRequests, pace, refusal, secagg_step
from edge_agent.ops.resume import LocalState
from edge_agent.training.models import resolve_arch
from protofl import topics
from protofl.errors import ConfigError, ProtoFLError, RevokedError, WireError
from protofl.names import printable
from protofl.traits import Traits, device_traits
from protofl.transport.broker_url import BrokerOptions
from protofl.transport.mqtt import MqttTransport
from protofl.wire import Config, RoundStart, Status, decode_message

log = logging.getLogger("protofl.edge")
SERVER_UP = ("waiting", "running")
# Several runners in one process (tests, benchmarks) share torch's global RNG, which model
# construction and dropout use: agent work is serialised so each client's run stays reproducible.
_AGENT_LOCK = threading.Lock()
RETRY_S = 5.0  # a failed round is tried again after this long
MAX_ATTEMPTS = 3


@dataclass(frozen=True)
class RunnerOptions:
    arch: str | None = None
    device: str = "cpu"
    profile: str = ""
    eval_every: int = 1
    test_every: int | None = None  # simulation data only: the official test set's cadence
    protocol: Literal["auto", "5", "3.1.1"] = "auto"
    connect_timeout: float = 30.0
    extractor: str = "torch"  # what computes prototypes and metrics: torch | onnx (onnxruntime)
    emulation: Emulation | None = None  # --profile: upload budget; in simulation, compute time and time scale
    state_dir: str | None = None  # --state-dir: a local checkpoint after every round, to resume after a restart
    artifacts: str | None = None  # where this device's deployable artifacts go (default: STATE_DIR/artifacts)
    tags: tuple[str, ...] = ()  # `join --tag`: what a run's selection may pick this device by (protofl/traits.py)
    memory_limit: bool = True  # with a device profile: hold this process to its memory_mb (edge_agent/core/memory.py)


class DeviceRunner(Carrier):
    def __init__(
        self, broker: BrokerOptions, fed: str, client_id: str, data: DataSpec, opts: RunnerOptions = RunnerOptions()
    ) -> None:
        self.fed = fed
        self.client_id = client_id
        self.data = data
        self.opts = opts
        self.presence = Presence(fed, client_id)
        self.transport = MqttTransport(
            broker, client_id, will=self.presence.will(), deliver="pump", protocol=opts.protocol
        )
        self.agent: EdgeAgent | None = None
        self.server_state = ""
        self.joined = False
        self.fatal: BaseException | None = None
        self._rounds_subscribed = False
        self.outbox = Outbox(self.transport, opts.emulation, client_id, topics.round_(fed))
        self._tickets: list[Ticket] = []  # the sends of the outcome being carried
        # Said once the broker acknowledged all of its tickets: (tickets, what the round did, its bytes' line).
        self._unconfirmed: deque[tuple[list[Ticket], str, str]] = deque()
        self._stop = threading.Event()
        self.retry = Retry(RETRY_S, MAX_ATTEMPTS)  # read now: tests shorten RETRY_S
        self.local = LocalState(client_id, data, opts.state_dir, opts.artifacts)
        self.requests = ResendRequests(fed, client_id)
        self.fleet = FleetMember(fed)

    # -- lifecycle ------------------------------------------------------------------------------
    def run(self, timeout: float | None = None) -> EdgeAgent | None:
        """Take part until the federation finishes (or `stop()` / `timeout`); returns the agent."""
        if self.opts.arch is not None:
            resolve_arch(self.opts.arch)  # an --arch that names no model fails here, not after the config came
        mark("imports")
        limit = self._memory_limit()
        self.transport.connect(self.opts.connect_timeout)
        self._presence("online", self.profile_label, traits=self.traits())
        mark("connect")
        self.transport.subscribe(topics.fleet(self.fed), self._on_fleet)  # before the config: says whose it is
        self.transport.subscribe(topics.config(self.fed), self._on_config)
        self.transport.subscribe(topics.server_status(self.fed), self._on_status)
        end = None if timeout is None else time.monotonic() + timeout
        try:
            while not self._stop.is_set() and self.fatal is None:
                self.transport.pump(0.5)
                self._check_revoked()
                self._confirm()
                again = self.retry.due(time.monotonic())
                if again is not None:
                    self._on_round(*again)
                if self.agent is not None and self.agent.finished and self.fleet.run is not None:
                    self._run_over("finished")
                elif self.agent is not None and self.agent.finished:
                    self.transport.expect_end()
                    log.info(
                        "%s: federation finished after %d trained round(s)",
                        self.client_id,
                        self.agent.stats.rounds_trained,
                    )
                    break
                if end is not None and time.monotonic() > end:
                    raise TimeoutError(f"{self.client_id}: federation '{self.fed}' did not finish within {timeout} s")
        finally:
            self.outbox.close()  # what is held back (the last metrics) goes out first
            done = self.agent is not None and self.agent.finished
            if not done and self.agent is not None and self.agent.stats.rounds_trained and self.local.artifacts_dir:
                try:  # leaving early: what it trained so far is still deployable
                    self.carry(Outcome(artifacts=self.agent.deployable()))
                except (ValueError, RuntimeError) as exc:  # never hides why the loop ended
                    log.error("%s: could not collect its artifacts: %s", self.client_id, exc)
            if self.transport.connected:
                self._presence("done" if done else "offline", "left")
            self.transport.close()
            self._confirm(final=True)
            if limit is not None:
                limit.stop()
        if self.fatal is not None:
            raise self.fatal
        return self.agent

    def _check_revoked(self) -> None:
        """The broker refuses this device's credentials now, after it had let it in: it was revoked (`protofl-server
        devices revoke`) or its password changed. Retrying cannot help: it says so and leaves (`RevokedError`: join
        exits EXIT_REVOKED), what it queued while cut off never sent."""
        why = self.transport.credentials_gone
        if why and self.fatal is None:
            log.error(
                "%s: revoked: the broker refuses this device's credentials now (%s); it was revoked from the fleet "
                "(protofl-server devices revoke) or its password changed. Leaving; to take part again it needs new "
                "credentials (protofl-server devices add %s)",
                self.client_id,
                why,
                self.client_id,
            )
            self.fatal = RevokedError(
                f"{self.client_id} was revoked: the broker refuses its credentials ({why}); enrol it again "
                f"(protofl-server devices add {self.client_id}) and give it its new credentials file"
            )

    def _memory_limit(self) -> MemoryLimit | None:
        """With a device profile: this process held to its memory_mb (edge_agent/core/memory.py), saying on the
        presence topic why it leaves when it outgrows it. Only where this process is the device alone: a runner
        among others in one process (simulate's thread agents) would be charged for all of them."""
        em = self.opts.emulation
        if em is None or em.device is None or not self.opts.memory_limit:
            return None
        label = self.profile_label

        def said(message: str) -> None:
            if self.transport.connected:
                self._presence("offline", message)  # retained: why this device left stays readable
                self.transport.flush(2.0)

        return MemoryLimit(em.device.memory_mb, label, on_exceeded=said).start()

    def stop(self) -> None:
        """Leave at the next loop iteration (thread-safe; e.g. from a signal handler)."""
        self._stop.set()

    @property
    def profile_label(self) -> str:
        em = self.opts.emulation
        return self.opts.profile or (em.label if em is not None else "")

    def traits(self) -> Traits | None:
        """What this device says it is, now (its power state is read each time: it changes); None where it knows
        nothing to say (the join and presence are then the bytes they always were)."""
        em = self.opts.emulation
        link = em.link.name if em is not None and em.link is not None else ""
        traits = device_traits(link, self.opts.tags)
        return None if traits == Traits() else traits

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def _presence(
        self, state: str, detail: str = "", round_: int = 0, phase: str = "", traits: Traits | None = None
    ) -> None:
        payload = self.presence.payload(state, detail, round_, phase, traits)
        self.transport.publish(self.presence.topic, payload, retain=True)

    # -- a fleet's runs (edge_agent/ops/membership.py) ----------------------------------------------
    def _on_fleet(self, topic: str, payload: bytes) -> None:
        try:
            env, msg = decode_message(payload)
        except WireError as exc:
            log.warning("%s: bad fleet status: %s", self.client_id, exc)
            return
        if not isinstance(msg, Status) or env.fed != self.fed:
            return
        fleet, run = self.fleet, msg.detail if msg.state == "run" else ""
        if run == fleet.run:
            return
        log.info("%s: fleet '%s': %s", self.client_id, self.fed, f"run '{run}'" if run else "no run (waiting)")
        first, fleet.run = fleet.run is None, run
        if run in fleet.done:
            # Named again after another run or the fleet's idle (`run resume`): served again, from what its server
            # kept (its journal); what was done is of its earlier serving.
            fleet.done.remove(run)
        if run == "":
            # What was held belongs to the run that ended (one this device did not serve): its server cleared its
            # retained messages, but the transport hands no empty payload on, so they are dropped here.
            fleet.held.clear()
        if fleet.refused not in ("", run) and self.transport.connected:
            # Its retained "cannot serve run X" is X's alone: the next run's server reads this instead.
            fleet.refused = ""
            self._presence("online", self.profile_label, traits=self.traits())
        if self.agent is not None and first:
            fleet.agent_run = run  # its config came before the fleet said whose it is (the run's server says so after)
        elif self.agent is not None and run == "" and not self.agent.finished:
            # The run ended before its last round reached this device (`run stop`, or its server died and the fleet
            # said so: "failed"): the fleet is idle, what comes next (the next run's config, its server's status) is
            # the next run's, never this agent's.
            self._run_over(f"ended ({printable(msg.detail) or 'stopped'})")
        elif self.agent is not None and run not in ("", fleet.agent_run):
            self._run_over("replaced")
        if self.agent is None and fleet.serving:
            self._take_held()

    def _hold(self, topic: str, payload: bytes) -> bool:
        """Between a fleet's runs: True when `payload` is held for its run (or empty), not handled now."""
        if self.fleet.run is not None and self.agent is not None and self.agent.finished:
            self._run_over("finished")
        return self.fleet.hold(topic, payload, self.agent is not None)

    def _take_held(self) -> None:
        """The run is ours now: its config (then, once joined, its public set and round) as if they just came."""
        config = self.fleet.held.pop(topics.config(self.fed), None)
        if config is not None:
            self._on_config(topics.config(self.fed), config)

    def _take_held_rounds(self) -> None:
        """Joined a fleet's next run: its public set and round, which came before this device's agent did."""
        for topic, handler in ((topics.public(self.fed), self._on_public), (topics.round_(self.fed), self._on_round)):
            payload = self.fleet.held.pop(topic, None)
            if payload is not None and self.agent is not None:
                handler(topic, payload)

    def _run_over(self, why: str) -> None:
        """The fleet's run ended for this device (finished, or it cannot serve it): drop its agent and wait for the
        next run on the same connection, its retained messages held until then."""
        run = self.fleet.agent_run if self.agent is not None else self.fleet.run or ""
        if self.agent is not None:
            log.info(
                "%s: run '%s' %s after %d trained round(s); waiting for the fleet's next run",
                self.client_id,
                run,
                why,
                self.agent.stats.rounds_trained,
            )
        self.fleet.over(run)
        self.agent, self.joined = None, False
        self.retry.reset()
        if self.transport.connected:
            self._presence("online", f"run '{run}' over ({why}); waiting for the next run")

    def _cannot_serve(self, exc: BaseException) -> None:
        """A device that cannot serve a run: in a fleet it says so and waits for the next; alone it says so and
        leaves (the server counts the refusal and logs it: issue 55)."""
        run = self.fleet.run
        if run is None:
            self.fatal = exc
            if self.transport.connected:
                self._presence("online", f"{topics.CANNOT_JOIN} '{self.fed}': {exc}")
            return
        log.error("%s: %s '%s': %s; waiting for the fleet's next run", self.client_id, topics.CANNOT_SERVE, run, exc)
        self.agent = None
        self.fleet.over(run)
        self.joined = False
        self.fleet.refused = run
        self._presence("online", f"{topics.CANNOT_SERVE} '{run}': {exc}")

    # -- inputs (runner thread) -------------------------------------------------------------------
    def _on_config(self, topic: str, payload: bytes) -> None:
        if self._hold(topic, payload):
            return
        if self.fleet.run is not None and not payload:
            return  # the run's config cleared as it ended
        first = self.agent is None or self.agent.model is None
        try:
            with _AGENT_LOCK:
                out = self._config(topic, payload)
            if out is not None:
                self.carry(out)
        except Exception as exc:  # noqa: BLE001 - said and fatal: a device that cannot start must not idle (issue 43)
            if not first:
                raise  # a later config: the transport logs it and the federation goes on
            log.exception("%s: the federation config could not be handled", self.client_id)
            self._cannot_serve(
                ConfigError(
                    f"{self.client_id}: handling the federation config failed ({type(exc).__name__}: {exc}); "
                    "this device cannot take part, so it leaves"
                )
            )
            return
        # Outside the agent lock: in a fleet the join hands the run's held public set and round to their handlers,
        # which take the lock themselves (under it, a run whose server said "waiting" before the fleet named it
        # deadlocked the device).
        self._maybe_join()

    def _config(self, topic: str, payload: bytes) -> Outcome | None:
        """The config given to the agent (the first one builds it); its outcome, or None where there is none."""
        agent = self.agent
        if agent is None:
            # The first config: this device's data is loaded for it (a partition depends on the config), so it
            # is read here, once (edge_agent/core/device_config.py), and the agent adopts what was read.
            try:
                env, msg = decode_message(payload)
                if not isinstance(msg, Config):
                    return None
                read = read_config(msg)
            except (WireError, ConfigError) as exc:
                if isinstance(exc, ConfigError) and self.fleet.run is not None:
                    self._cannot_serve(exc)  # a fleet's run keeps its config: this device waits for the next run
                    return None
                log.error(
                    "%s: unusable federation config on %s: %s; waiting for a config this device can afford",
                    self.client_id,
                    topic,
                    exc,
                )
                if isinstance(exc, ConfigError):  # the server counts the refusal and says why (issue 55)
                    self._presence("online", f"{topics.CANNOT_JOIN} '{self.fed}': {exc}")
                return None
            try:
                agent = self.agent = self._build_agent(read)
                self.fleet.agent_run = self.fleet.run or ""
            except ProtoFLError as exc:
                self._cannot_serve(exc)  # e.g. the data does not fit this federation: nothing to retry
                return None

            def step() -> Outcome:
                return agent.handle(topic, env, msg, len(payload), config=read)
        else:

            def step() -> Outcome:
                return agent.receive(topic, payload)

        fresh = agent.model is None
        try:
            out = step()
        except ConfigError as exc:
            if not fresh:
                raise
            self._cannot_serve(exc)  # this device cannot build its model (e.g. its arch's factory fails)
            return None
        # A checkpoint is loaded into the agent's first model only: a later config (a server restarted with another)
        # starts that model afresh.
        return out if fresh else dataclasses.replace(out, configured=False)

    def _build_agent(self, read: DeviceConfig) -> EdgeAgent:
        cfg = read.cfg
        data = load_client_data(self.data, cfg, self.client_id)
        mark("data")
        arch = self.opts.arch
        if arch is None and self.data.partition is not None:
            arch = cfg.arch_for(self.data.partition[0])  # the simulator's round-robin assignment
        log.info(
            "%s: %d training / %d test samples, arch %s, preset %s",
            self.client_id,
            len(data.y_train),
            len(data.y_test),
            arch or cfg.archs[0],
            cfg.preset,
        )
        self.local.name_classes(cfg)
        return EdgeAgent(
            self.client_id,
            self.fed,
            data,
            arch=arch,
            profile=self.profile_label,
            traits=self.traits(),
            device=self.opts.device,
            eval_every=self.opts.eval_every,
            test_every=self.opts.test_every,
            extractor=self.opts.extractor,
            clock=self.outbox.clock,
            resends=True,
            artifacts_at=("first_training", "final") if self.local.artifacts_dir is not None else (),
        )

    def _on_status(self, topic: str, payload: bytes) -> None:
        try:
            env, msg = decode_message(payload)
        except WireError as exc:
            log.warning("%s: bad server status: %s", self.client_id, exc)
            return
        if not isinstance(msg, Status) or env.fed != self.fed:
            return
        if msg.state not in SERVER_UP:
            self.joined = False  # the server went away; join again when it is back
        elif msg.state == "waiting" and self.agent is not None and self.server_state != "waiting":
            # A server waiting for joins has opened no round yet: a fresh federation, whose round
            # numbers start again at 1.
            self.agent.restart()
        if msg.state == "waiting":
            # A waiting server announced itself (again): after a broker that died and lost our join with it
            # (it had acknowledged it to us), only a join sent now gets us in. A second join changes nothing.
            self.joined = False
        # A finished server stops its broker next: the run's end, not a fault (a fleet's next run: a fault again)
        self.transport.expect_end(msg.state == "finished")
        if msg.state != self.server_state:
            log.info("%s: server is %s%s", self.client_id, msg.state, f" ({msg.detail})" if msg.detail else "")
        self.server_state = msg.state
        self._maybe_join()

    def _maybe_join(self) -> None:
        agent = self.agent
        if agent is None or agent.model is None or self.joined or self.server_state not in SERVER_UP:
            return
        if not self._rounds_subscribed:
            # Our own `down/` topic before the join goes out: a refusal of the join comes there, at once.
            self.transport.subscribe(topics.down(self.fed, self.client_id), self._on_request)
        self.carry(agent.join())
        self.joined = True
        if not self._rounds_subscribed:
            self._rounds_subscribed = True
            self.transport.subscribe(topics.public(self.fed), self._on_public)
            self.transport.subscribe(topics.round_(self.fed), self._on_round)
        else:
            self._take_held_rounds()

    def _on_public(self, topic: str, payload: bytes) -> None:
        if self._hold(topic, payload) or self.agent is None:
            return
        self._give(self.agent, lambda agent: agent.receive(topic, payload))

    def _on_round(self, topic: str, payload: bytes) -> None:
        if self._hold(topic, payload) or self.agent is None:
            return
        if self.transport.waiting(topic) and not _never_skipped(payload):
            # A newer round message is already here (the server moved on while we trained: asynchronous rounds,
            # broker_server/core/buffered.py): training on this one would only make an older upload. A final one is
            # never skipped: it carries the federation's end and its artifacts.
            log.debug("%s: a round message skipped, a newer one waits behind it", self.client_id)
            return
        # When the message came off the wire: the time this thread was busy before it is not our compute.
        recv_t = self.transport.arrived.get(topic, time.time())
        with self.outbox.round(recv_t):
            self._give(self.agent, lambda agent: agent.receive(topic, payload, recv_t=recv_t), (topic, payload))

    def _on_request(self, topic: str, payload: bytes) -> None:
        """The server asks again for what the broker may have dropped: our join, a phase's uploads, or a round's
        metrics; or it refuses our join for good (e.g. another architecture than the federation's model): we stop."""
        why = refusal(payload, self.fed)
        if why is not None:
            self._cannot_serve(ConfigError(f"{self.client_id}: the server refused this device's join: {why}"))
            return
        if self.agent is not None and secagg_step(payload, self.fed):  # a step of the phase's secure aggregation
            self._give(self.agent, lambda agent: agent.receive(topic, payload))
            return
        paced = pace(payload, self.fed)
        if paced is not None:  # not in that round: nothing to train; its round message leaves us out too
            back = time.strftime("%H:%M:%S", time.localtime(paced[1].until))
            log.info("%s: not in round %d (%s); the server expects us back at %s", self.client_id, paced[0],
                     paced[1].reason, back)  # fmt: skip
            return
        got = self.requests.read(payload, time.monotonic())
        if got is None or self.agent is None:
            return
        env, msg = got
        if msg.ask == "join":
            if self.server_state in SERVER_UP:
                log.info("%s: the server asks for our join again", self.client_id)
                self.joined = False
                self._maybe_join()
        else:
            self.carry(self.agent.resend(msg.ask, env.round, env.phase))  # cheap: not behind others' training

    def _give(
        self, agent: EdgeAgent, step: Callable[[EdgeAgent], Outcome], round_msg: tuple[str, bytes] | None = None
    ) -> None:
        """A message given to the agent under the lock (torch's global RNG), its outcome carried out after it.
        `round_msg`: the round message given, tried again if its round fails (not one whose uploads only went
        again)."""
        with _AGENT_LOCK:
            out = step(agent)
        if round_msg is not None and not out.resent:
            self.retry.seen(round_msg)
        self.carry(out)

    # -- the agent's outcomes (edge_agent/core/outcome.py: `carry` is the one path) ------------------
    def checkpoint(self) -> None:
        if self.agent is not None and self.opts.state_dir is not None:
            with _AGENT_LOCK:  # this round's work survives a restart of the device, before it leaves
                self.local.save(self.agent, self.fleet.checkpoint_key)

    def configured(self) -> None:
        if self.agent is not None and self.opts.state_dir is not None:
            with _AGENT_LOCK:  # our own last local state, into the model the config built
                self.local.resume(self.agent, self.fleet.checkpoint_key)

    def publish(self, send: Send) -> None:
        self._tickets.append(self.outbox.send(send))

    def deploy(self, artifacts: DeviceArtifacts) -> None:
        self.local.deploy(artifacts)

    def failed(self, failure: Failure) -> None:
        """Say on our presence topic that a round failed here (the server logs it), and plan a retry; after the
        last try we leave this phase: the server closes it at quorum instead of waiting for its deadline (the
        envelope says which round and phase)."""
        state, detail = self.retry.failed(failure, time.monotonic())
        log.warning("%s: %s", self.client_id, detail)
        at = (failure.round, failure.phase) if state == GAVE_UP else (0, "")
        self._presence(state, detail, *at)

    def left(self, left: Failure) -> None:
        """Leave a phase the server asked something this device refuses: our presence says why (the server logs it
        and stops waiting for us in that phase: `GAVE_UP`); no retry, the next round is taken as usual."""
        self._presence(GAVE_UP, left.reason, left.round, left.phase)

    def carried(self, out: Outcome) -> None:
        """The log lines: what a round message made this device send, or what it sent again."""
        tickets, self._tickets = self._tickets, []
        if not out.sends:
            return
        first = out.sends[0]
        if out.resent and first.kind == "metrics":  # the server asked for a round's metrics
            log.info("%s: round %d's metrics asked again by the server; re-sent", self.client_id, first.round)
        elif out.resent:  # the round message came again, or the server asked for a phase's uploads
            log.info(
                "%s: round %d %s %s; re-sent %d upload(s)",
                self.client_id,
                first.round,
                first.phase,
                out.resent,
                len(out.sends),
            )
        elif out.changed or out.trained or out.failure is not None:  # a round message's work (the join: no line)
            # Each message by kind, as the server counts it (the MQTT payload, envelope included: `status` shows
            # the same figure for a device's last upload), and their sum.
            what = "trained" if out.trained else "prototype phase"
            sizes = f"{out.nbytes} bytes ({', '.join(f'{s.kind} {len(s.payload)} B' for s in out.sends)})"
            if not self.transport.connected:  # cut off (a broker restart, a revocation): sent if it gets back in
                log.info("%s: %s, not connected: queued %s", self.client_id, what, sizes)
            self._unconfirmed.append((tickets, what, sizes))
            self._confirm()

    def _confirm(self, final: bool = False) -> None:
        """The rounds' "uploaded" lines whose messages the broker has all acknowledged, in order; `final` (the loop
        ended, the transport closed after its flush): what never was, said so."""
        while self._unconfirmed:
            tickets, what, sizes = self._unconfirmed[0]
            if all(self.outbox.acknowledged(t) for t in tickets):
                log.info("%s: %s, uploaded %s", self.client_id, what, sizes)
            elif final:
                why = (
                    "never sent: it left before they could go"
                    if any(t.seq is None for t in tickets)
                    else "sent but never acknowledged: the broker may not hold them"
                )
                log.warning("%s: %s, %s %s", self.client_id, what, sizes, why)
            else:
                return
            self._unconfirmed.popleft()


def _never_skipped(payload: bytes) -> bool:
    """A round message handled even when a newer one waits: the federation's last (its end and its artifacts), or
    one this cheap look cannot tell (the agent decodes it with the federation's limits and says what is wrong)."""
    try:
        msg = decode_message(payload)[1]
    except ProtoFLError:
        return True
    return not isinstance(msg, RoundStart) or msg.final
