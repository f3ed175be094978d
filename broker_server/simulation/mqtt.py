"""`simulate --transport mqtt`: the in-process federation, through a real broker.

The aggregator runs in this process as an `AggregatorService`; every client is a separate
`protofl-edge join` process that loads its own share of the same (dataset, N, alpha, seed) partition
(`--partition i/N`), so the run reproduces the in-process one. `agents="thread"` runs the same
`DeviceRunner`s as threads of this process instead (tests: no interpreter start-up per client).
A local Mosquitto gets the generated password file and ACL, and every side its own credentials, as
`protofl-server start` does (the embedded amqtt broker enforces none: local development only).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from broker_server import settings
from broker_server.core.shell import Aggregator, decoder_limits
from broker_server.ops.broker import PACKET_HEADROOM, start_local_broker
from broker_server.ops.security import BrokerAuth, load_or_create
from broker_server.service import AggregatorService, server_transport
from broker_server.simulation.deploy import join_artifact_args
from broker_server.simulation.links import Links, UploadWatcher
from broker_server.simulation.memory import MALLOC_ENV
from broker_server.simulation.report import Report, describe_drops
from broker_server.simulation.spec import FED, Federation, SimulationSpec, client_id
from broker_server.simulation.timeline import LinkReport
from edge_agent.core.memory import EXIT_OVER_MEMORY
from protofl.errors import ConfigError
from protofl.profiles import DeviceClass
from protofl.transport.broker_url import PASSWORD_ENV, BrokerOptions, parse_broker_url

if TYPE_CHECKING:
    from edge_agent.core.emulation import Emulation, ReleaseOrder

log = logging.getLogger("protofl.simulate")
REPO = Path(__file__).resolve().parents[2]


def device_options(broker: BrokerOptions, auth: BrokerAuth | None, client: str) -> BrokerOptions:
    """The broker options of one simulated device: its own credentials when the broker checks them."""
    if auth is None:
        return broker
    cred = auth.secrets.device(client)
    return broker.with_auth(cred.username, cred.password)


def profile_args(spec: SimulationSpec, device: DeviceClass | None) -> list[str]:
    """`protofl-edge join` arguments of a simulated device with a profile (none without --profiles)."""
    if device is None:
        return []
    return [
        "--profile",
        device.spec or device.name,
        "--time-scale",
        repr(spec.time_scale),
        "--emulate-compute",
        "--upload-share",
        repr(spec.upload_share),
        "--adaptive" if spec.adaptive else "--no-adaptive",
        *(["--sample-cost", repr(spec.sample_cost_s)] if spec.sample_cost_s else []),
    ]


def emulation(spec: SimulationSpec, device: DeviceClass | None, order: ReleaseOrder | None = None) -> Emulation | None:
    """What `profile_args` says, for a device runner in this process; `order`: the thread agents' shared release
    order (edge_agent/core/emulation.py)."""
    if device is None:
        return None
    from edge_agent.core.emulation import Emulation

    return Emulation(
        device=device.device,
        link=device.link,
        time_scale=spec.time_scale,
        emulate_compute=True,
        adaptive=spec.adaptive,
        upload_share=spec.upload_share,
        order=order,
        sample_cost_s=spec.sample_cost_s,
    )


def join_args(spec: SimulationSpec, broker: BrokerOptions, protocol: str, index: int) -> list[str]:
    """`protofl-edge join` arguments for client `index` of the simulated federation."""
    args = [
        "--broker",
        broker.url,
        "--fed",
        FED,
        "--client-id",
        client_id(index),
        "--data",
        spec.dataset,
        "--partition",
        f"{index}/{spec.clients}",
        "--alpha",
        repr(spec.alpha),
        "--seed",
        str(spec.seed),
        "--eval-every",
        str(spec.eval_every),
        "--extractor",
        spec.extractor,
        "--device",
        spec.device,
        "--threads",
        "1",
        "--mqtt",
        protocol,
        *join_artifact_args(spec),
    ]
    for flag, value in (
        ("--data-dir", spec.data_dir),
        ("--test-limit", spec.test_limit),
        ("--test-every", spec.test_every),
        ("--train-limit", spec.train_limit),
        ("--username", broker.username),
        ("--tls-ca", broker.tls_ca),
        ("--tls-cert", broker.tls_cert),
        ("--tls-key", broker.tls_key),
    ):
        if value is not None:
            args += [flag, str(value)]
    return args


class AgentProcesses:
    """One `python -m edge_agent.cli join ...` per client, output in a log file each."""

    def __init__(
        self,
        spec: SimulationSpec,
        broker: BrokerOptions,
        protocol: str,
        auth: BrokerAuth | None = None,
        links: Links | None = None,
    ) -> None:
        self.spec, self.broker, self.protocol, self.auth, self.links = spec, broker, protocol, auth, links
        self._tmp = tempfile.TemporaryDirectory(prefix="protofl-agents-")
        self.procs: list[subprocess.Popen[bytes]] = []

    def log_path(self, i: int) -> Path:
        return Path(self._tmp.name) / f"{client_id(i)}.log"

    def start(self) -> None:
        base = dict(
            os.environ,
            **MALLOC_ENV,  # the device processes keep the memory they free, as the simulator's own (memory.py)
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        )
        # N torch processes on this machine's cores: their OpenMP threads sleep when idle rather than spin on
        # cores the other devices need (one small run beside two others: half the CPU time, the same report).
        base.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        for i in range(self.spec.clients):
            # the device's own link (a shaping proxy with --profiles) and its own credentials
            broker = device_options(
                self.links.broker_for(i) if self.links is not None else self.broker, self.auth, client_id(i)
            )
            device = self.links.devices[i] if self.links is not None else None
            env = dict(base)
            if broker.password is not None:
                env[PASSWORD_ENV] = broker.password  # not on the command line, where ps shows it
            cmd = [
                sys.executable,
                "-m",
                "edge_agent.cli",
                "join",
                *join_args(self.spec, broker, self.protocol, i),
                *profile_args(self.spec, device),
                "--keepalive",
                str(broker.keepalive),
            ]
            with self.log_path(i).open("wb") as out:
                self.procs.append(
                    subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
                )

    def check(self) -> None:
        """Raise if an agent failed; a clean exit (the federation finished for it) is fine."""
        for i, p in enumerate(self.procs):
            rc = p.poll()
            if rc not in (None, 0):
                tail = self.log_path(i).read_text(errors="replace")[-1500:]
                if rc == EXIT_OVER_MEMORY:  # its profile's memory: what the device says is the whole story
                    said = tail.rsplit("over the memory of device profile", 1)[-1]
                    raise ConfigError(f"agent {client_id(i)} left: over the memory of device profile{said.rstrip()}")
                raise RuntimeError(f"agent {client_id(i)} exited with status {rc}:\n{tail}")

    def alive(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def dropped(self) -> None:
        """Separate processes: their drops are in their logs, not readable here."""
        return None

    def stop(self, timeout: float = 15.0) -> None:
        """Give agents time to see the final round and leave; then SIGTERM, then SIGKILL."""
        end = time.monotonic() + timeout
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.0, end - time.monotonic()))
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._tmp.cleanup()


class AgentThreads:
    """The same `DeviceRunner`s as threads of this process."""

    def __init__(
        self,
        spec: SimulationSpec,
        broker: BrokerOptions,
        protocol: str,
        auth: BrokerAuth | None = None,
        links: Links | None = None,
    ) -> None:
        from edge_agent.core.emulation import ReleaseOrder
        from edge_agent.ops.local_data import DataSpec
        from edge_agent.ops.runner import DeviceRunner, RunnerOptions

        # One process trains every device in turn: their uploads leave in emulated order, whatever the load.
        self.order: ReleaseOrder | None = ReleaseOrder() if links is not None else None

        def opts(i: int) -> RunnerOptions:
            device = links.devices[i] if links is not None else None
            return RunnerOptions(
                device=spec.device,
                eval_every=spec.eval_every,
                test_every=spec.test_every,
                protocol=protocol,  # type: ignore[arg-type]
                extractor=spec.extractor,
                emulation=emulation(spec, device, self.order),
                artifacts=spec.out_dir,
                memory_limit=False,  # one process for every device (and the simulator): no device's memory alone
            )

        self.runners = [
            DeviceRunner(
                device_options(links.broker_for(i) if links is not None else broker, auth, client_id(i)),
                FED,
                client_id(i),
                DataSpec(
                    spec.dataset,
                    spec.data_dir,
                    (i, spec.clients),
                    spec.alpha,
                    spec.seed,
                    spec.test_limit,
                    spec.train_limit,
                ),
                opts(i),
            )
            for i in range(spec.clients)
        ]
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._run, args=(r,), daemon=True) for r in self.runners]

    def _run(self, runner: Any) -> None:
        try:
            runner.run()
        except BaseException as exc:  # noqa: BLE001 - reported by check()
            self.errors.append(exc)

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def check(self) -> None:
        if self.errors:
            raise RuntimeError(f"an agent thread failed: {self.errors[0]!r}") from self.errors[0]

    def alive(self) -> bool:
        return any(t.is_alive() for t in self.threads)

    def dropped(self) -> dict[str, dict[str, int]]:
        """Each agent's dropped messages by reason (an agent not built yet has dropped nothing)."""
        return {r.client_id: dict(r.agent.stats.dropped) if r.agent is not None else {} for r in self.runners}

    def stop(self, timeout: float = 15.0) -> None:
        end = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, end - time.monotonic()))
        for r in self.runners:
            r.stop()
        for t in self.threads:
            t.join(5)


def run_over_mqtt(
    spec: SimulationSpec, fed_data: Federation, report: Report, initial_params: np.ndarray | None
) -> Aggregator:
    """Run the federation to its last round through a broker; returns the service's aggregator."""
    if spec.agents not in ("process", "thread"):
        raise ConfigError(f"agents must be 'process' or 'thread', got '{spec.agents}'")
    cfg = fed_data.cfg
    with contextlib.ExitStack() as stack:
        auth = None
        if spec.broker is None:
            sec_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="protofl-security-")))
            auth = load_or_create(sec_dir, FED, spec.client_ids)
            # The broker refuses packets the aggregator would not decode anyway.
            packet = decoder_limits(cfg, None if initial_params is None else len(initial_params)).max_message_bytes
            local = start_local_broker(
                spec.broker_kind,  # type: ignore[arg-type]
                auth_lines=auth.mosquitto_lines(),
                max_packet_size=packet + PACKET_HEADROOM,
            )
            stack.callback(getattr(local, "cleanup", local.stop))
            broker, protocol = parse_broker_url(local.url), local.protocol
            auth = auth if local.kind == "mosquitto" else None  # amqtt checks no credentials
        else:
            broker, protocol = spec.broker, "auto"
        server = broker.with_auth(auth.secrets.server.username, auth.secrets.server.password) if auth else broker
        links, deadline_s = None, cfg.round_timeout
        if spec.profiles:
            # FedAvg's round message carries the model (f4): the largest message a link carries.
            largest = 4 * len(initial_params) if initial_params is not None else 0
            links = Links(spec.fleet(), broker, spec.time_scale, spec.seed, largest).start()
            stack.callback(links.close)
            # The server's deadline runs on real time: the simulated deadline, time_scale times faster.
            cfg = cfg.replace(round_timeout=cfg.round_timeout / spec.time_scale)
        federation = settings.Federation(
            cfg,
            FED,
            public=fed_data.public_set(),
            initial_params=initial_params,
            expected_clients=spec.client_ids,
            limits=fed_data.limits(initial_params),
            policy=spec.policy(),
            time_scale=spec.time_scale if spec.profiles else 1.0,
        )
        hooks = settings.Hooks(
            on_round_end=lambda rec: report.on_round_end(rec, service.aggregator.model), on_metrics=report.on_metrics
        )
        transport = server_transport(settings.Broker(server, protocol), FED)
        service = AggregatorService(federation, transport, hooks=hooks)
        if links is not None:
            watcher = UploadWatcher(transport, FED).start()  # subscribed before any device uploads
            report.links = LinkReport(
                links.devices,
                spec.client_ids,
                links,
                watcher,
                time_scale=spec.time_scale,
                deadline_s=deadline_s,
                adaptive=spec.adaptive,
                upload_share=spec.upload_share,
                nominal=spec.sample_cost_s > 0,
            )
        service.start()
        stack.callback(service.close)
        agents = (AgentProcesses if spec.agents == "process" else AgentThreads)(spec, broker, protocol, auth, links)
        if report.links is not None:
            report.links.order = getattr(agents, "order", None)  # thread agents: the machine's holds, not the links'
        agents.start()
        finished = False
        # Finished: give agents time to see the final round and leave; failed: stop them now.
        stack.callback(lambda: agents.stop(15.0 if finished else 0.0))
        progress = report.progress

        def until() -> bool:
            agents.check()
            if not service.finished and not agents.alive():
                raise RuntimeError(
                    f"every agent left before the federation finished (round {service.aggregator.round})"
                )
            progress.poll(time.time())
            # A device evaluates after its last upload, so the last round's metrics come after the close;
            # they always come (an agent leaves only after sending them), unless the agent died.
            metrics_in = progress.all_metrics_in() or not agents.alive()
            done = service.finished and progress.emitted >= cfg.rounds and metrics_in
            if done and report.links is not None and agents.alive():
                # A device that missed a round still reports its timings for the timeline, behind its late
                # upload: wait for them a while (a device that never got the round message sends none).
                done = report.links.timings_in(report.metrics) or report.links.grace_over(time.monotonic())
            return done

        try:
            service.run(until=until, timeout=spec.timeout)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}; {describe_drops(service.aggregator.dropped, agents.dropped())}") from None
        finished = True
        return service.aggregator
