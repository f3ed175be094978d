"""What a simulation runs: the spec a user gives, the config it resolves to, and the federation's data.

The data side (`prepare`) depends only on (dataset, N, alpha, seed) and the limits, never on the
preset, so every method is compared on the same clients. numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from broker_server.cli_common import data_shape, fixed_by_user, sets
from broker_server.core.shell import decoder_limits
from broker_server.simulation.links import expand
from protofl.algorithms.robust import ClipPolicy
from protofl.config import FederationConfig
from protofl.data import Dataset, FederatedSplit, load_dataset
from protofl.data.classnames import data_class_names
from protofl.data.federation import federation_split, fit_public, limit_train, public_set
from protofl.errors import ConfigError
from protofl.presets import make_config
from protofl.profiles import DeviceClass, parse_fleet
from protofl.schedule import check_cadence
from protofl.transport.broker_url import BrokerOptions
from protofl.wire import Limits, Metrics, PublicSet

TRANSPORTS = ("inprocess", "mqtt")
BACKENDS = ("local", "ray")  # where the devices run: this process (or its agent processes), or Ray workers
EXTRACTORS = ("torch", "onnx")
FED = "sim"  # the simulated federation's name (its topics live under protofl/sim/)


def client_id(index: int) -> str:
    """The id of simulated client `index`; client i holds share i of the partition."""
    return f"client-{index:03d}"


@dataclass
class SimulationSpec:
    preset: str = "protofl"
    dataset: str = "synthetic"
    data_dir: str | None = None
    clients: int = 5
    alpha: float = 0.5
    rounds: int = 3
    seed: int = 0
    archs: tuple[str, ...] | None = None
    transport: str = "inprocess"  # or "mqtt": a real broker, agents as separate processes
    broker: BrokerOptions | None = None  # mqtt: None = start a local broker (mosquitto, else amqtt)
    broker_kind: str = "auto"  # the local broker: auto | mosquitto | amqtt
    agents: str = "process"  # mqtt: "process" (protofl-edge join per client) or "thread" (tests)
    timeout: float | None = None  # mqtt: give up after this many seconds
    config_file: str | None = None
    train_limit: int | None = None  # use a seeded random subset of N training samples (faster runs)
    test_limit: int | None = None  # evaluate global/ensemble accuracy on the first N test samples
    eval_every: int = 1
    test_every: int | None = None  # score the official test set every N rounds and in the last (None: the last only)
    extractor: str = "torch"  # agents extract prototypes with torch or onnxruntime ("onnx")
    device: str = "cpu"  # torch device of the agents and of FedAvg's global model: cpu | cuda | auto
    overrides: dict[str, Any] = field(default_factory=dict)
    # Constrained links (mqtt): a fleet `rpi4+lte:4,...`, one shaping proxy per device; the time scale
    # speeds links, delays, deadlines and compute waits up alike; adaptive uploads fit each link.
    profiles: str | None = None
    time_scale: float = 1.0
    adaptive: bool = True
    upload_share: float = 0.8
    # The virtual clock's compute from the profiles (s of training per sample held; 0: measured CPU time) and, with
    # it, link times from the profiles (broker_server/simulation/timeline.py): times independent of the load.
    sample_cost_s: float = 0.0
    out_dir: str | None = None  # leave the run's deployable artifacts here (protofl/artifacts.py)
    # Upload clipping (a defence, not a paper's method): on by default as in `start`, so that a simulation
    # runs the aggregator a deployment runs; the benchmark's papers' rows turn it off.
    clip: bool = True
    # --backend ray (broker_server/simulation/ray_backend.py): the devices on Ray workers, the aggregator here.
    backend: str = "local"
    ray_address: str | None = None  # join this cluster (auto, host:port, ray://...); None: start a local one
    device_resources: str = "cpu=1"  # each device's share of a node, cpu=N[,gpu=N]
    ray_workers: int | None = None  # at most this many workers (default: as many as the cluster holds)
    ray_max_restarts: int = 1  # a worker whose process dies is started again this often, then its devices are lost

    def policy(self) -> ClipPolicy:
        """The server's clipping policy: the defaults, switched on or off."""
        return ClipPolicy(enabled=self.clip)

    def fleet(self) -> list[DeviceClass]:
        """One device class per client (empty without --profiles)."""
        if not self.profiles:
            return []
        return expand(parse_fleet(self.profiles), self.clients)

    @property
    def client_ids(self) -> list[str]:
        return [client_id(i) for i in range(self.clients)]


@dataclass
class Federation:
    """The data side of a simulation: identical for every preset given (dataset, N, alpha, seed)."""

    train: Dataset
    test: Dataset
    split: FederatedSplit
    cfg: FederationConfig
    _public: tuple[PublicSet | None] | None = field(default=None, init=False, repr=False, compare=False)

    def public_set(self) -> PublicSet | None:
        """The public message: the public set where the plan uses it, the shared backbone where one travels
        (trained here, once per simulation: torch runs the devices anyway)."""
        if self._public is None:
            from edge_agent.training.backbone import with_backbone

            self._public = (with_backbone(self.cfg, self.train, public_set(self.train, self.cfg)),)
        return self._public[0]

    def limits(self, initial_params: np.ndarray | None) -> Limits:
        """The aggregator's decoder limits: the federation's, and room in a metrics message for the class
        probabilities on the test set that simulated devices send (ensemble accuracy); a device in the
        field sends none, so `start` keeps the small default."""
        lim = decoder_limits(self.cfg, None if initial_params is None else len(initial_params))
        probs = Metrics.probs_bytes(len(self.test.y), self.cfg.num_classes)
        return replace(lim, max_metrics_bytes=lim.max_metrics_bytes + probs)


def resolve_config(
    spec: SimulationSpec,
    num_classes: int | None = None,
    in_shape: tuple[int, ...] | None = None,
    class_names: list[str] | None = None,
) -> FederationConfig:
    """The config a simulation of `spec` runs with; the dataset's classes, input shape and class names, where
    given, win (`prepare` loads the data to fit what `--set`/`--config`/`--classes` fixed, so the two agree)."""
    overrides = dict(spec.overrides)
    # Over shaped links a round must be able to close at its deadline without the slow devices.
    min_clients = int(overrides.get("min_clients", 1)) if spec.profiles else spec.clients
    overrides.update(rounds=spec.rounds, seed=spec.seed, min_clients=min_clients)
    if num_classes is not None:
        overrides["num_classes"] = num_classes
    if in_shape is not None:
        overrides["in_shape"] = tuple(in_shape)
    if class_names is not None:
        overrides["class_names"] = list(class_names)
    if spec.archs:
        overrides["archs"] = tuple(spec.archs)
    return make_config(spec.preset, spec.config_file, **overrides)


def check_backend(spec: SimulationSpec) -> None:
    """The Ray backend's options, checked before any data loads (Ray itself is checked when the run starts)."""
    if spec.backend not in BACKENDS:
        raise ConfigError(f"--backend must be {' or '.join(BACKENDS)}, got '{spec.backend}'")
    if spec.backend == "local":
        return
    if spec.transport != "inprocess":
        raise ConfigError(
            "--backend ray runs the devices on Ray workers and the broker in this process: "
            "leave out --transport mqtt (and --profiles, which shape real broker links)"
        )
    if spec.ray_workers is not None and spec.ray_workers < 1:
        raise ConfigError(f"--ray-workers must be >= 1, got {spec.ray_workers}")
    if spec.ray_max_restarts < 0:
        raise ConfigError(f"--ray-max-restarts must be >= 0, got {spec.ray_max_restarts}")


def prepare(spec: SimulationSpec) -> Federation:
    """Check the spec, load the data and partition it; the config is resolved for the dataset."""
    if spec.clients < 1:
        raise ConfigError(f"--clients must be >= 1, got {spec.clients}")
    if not spec.alpha > 0:
        raise ConfigError(f"--alpha must be > 0, got {spec.alpha}")
    check_cadence(spec.eval_every, spec.test_every)
    check_backend(spec)
    if spec.profiles:
        if spec.transport != "mqtt":
            raise ConfigError("--profiles emulates links in front of a real broker: add --transport mqtt")
        if not spec.time_scale > 0:
            raise ConfigError(f"--time-scale must be > 0, got {spec.time_scale}")
        if not 0 < spec.upload_share <= 1:
            raise ConfigError(f"--upload-share must be in (0, 1], got {spec.upload_share}")
        if not spec.sample_cost_s >= 0:
            raise ConfigError(f"--sample-cost must be >= 0 seconds per sample, got {spec.sample_cost_s}")
        spec.fleet()  # unknown profiles and a --clients that does not match fail here, before any data loads
    elif spec.sample_cost_s:
        raise ConfigError("--sample-cost times a fleet's compute from its profiles: add --profiles")
    if spec.extractor not in EXTRACTORS:
        raise ConfigError(f"--extractor must be {' or '.join(EXTRACTORS)}, got '{spec.extractor}'")
    fixed = fixed_by_user(spec.config_file, spec.overrides)  # --set num_classes / in_shape: the data must fit them
    train, test = load_dataset(
        spec.dataset, data_dir=spec.data_dir, seed=spec.seed, **data_shape(fixed, lambda: resolve_config(spec))
    )
    train = limit_train(train, spec.train_limit, spec.seed)
    # Own data that names its classes (class folders, an npz's class_names) names the federation's, unless the user
    # did (--classes); Fashion-MNIST's names stay out of the config (its devices read ids; the artifacts name them).
    named = None
    if "class_names" not in fixed and spec.dataset.partition(":")[0].strip().lower() in ("imagefolder", "npz"):
        named = data_class_names(spec.dataset, train.num_classes)
    cfg = resolve_config(spec, train.num_classes, tuple(train.in_shape), named)
    cfg = fit_public(train, cfg, fixed=sets(spec.config_file, spec.overrides, "public_per_class"))
    split = federation_split(train, spec.clients, spec.alpha, spec.seed, cfg)  # what --partition i/N loads
    if spec.test_limit is not None:
        test = test.subset(np.arange(min(spec.test_limit, len(test))))
    return Federation(train, test, split, cfg)
