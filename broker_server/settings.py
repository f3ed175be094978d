"""The server's settings, grouped: what the CLIs (start_cli.py, shard_cli.py) build once from their options and
the services (service.py, shard_service.py) take, instead of a keyword argument per option.

Each group is a frozen dataclass, validated when it is built (a `ConfigError` names the option that was wrong),
with its defaults here and nowhere else (the CLIs' options take theirs from these):

    Federation   what runs: the config, its name, the public set, the initial model, decoder limits, clipping,
                 the devices expected before round 1, how long a device that dropped keeps its place, and the
                 server's own labelled data that scores the global predictor (`Validation`)
    Admission    who may take part (security): the members, the cap on clients
    Durability   --state-dir: the journal and checkpoint, fsync and group commit
    Sharding     --shards/--sites: who folds the uploads, and how long a close waits for a shard
    Pacing       the service thread: its tick, how long a round's line waits for metrics, re-send requests at once
    Watchers     what watches the server: the snapshot board, the Prometheus metrics, the broker's restarts
    Hooks        what the embedding code is told: rounds closed, metrics in, rounds logged
    Broker       the broker connection a transport is built from (service.server_transport)
    ShardSettings one aggregator shard (`protofl-server shard`)

numpy only.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from broker_server.core.progress import GRACE_S
from broker_server.core.rounds import OFFLINE_GRACE_S, RoundRecord
from broker_server.ops.capacity import DEFAULT_QUEUE
from protofl import learning
from protofl.algorithms.robust import ClipPolicy
from protofl.config import FederationConfig
from protofl.errors import ConfigError
from protofl.plan import Phase
from protofl.transport.broker_url import CONNECT_TIMEOUT_S, BrokerOptions
from protofl.transport.mqtt import DEFAULT_SESSION_EXPIRY_S
from protofl.wire import Limits, Metrics, PublicSet

if TYPE_CHECKING:
    from broker_server.core.stages import ServerModel
    from broker_server.ops.privacy_ledger import FleetView
    from broker_server.watch.board import SnapshotBoard
    from broker_server.watch.metrics import FederationMetrics

# How long a closing phase waits for a shard's partial (the coordinator's --shard-timeout), and how long the broker
# keeps a gone shard's session (`protofl-server shard --shard-timeout`): far beyond a spawned shard's restart
# (seconds), short of a stalled federation.
DEFAULT_SHARD_TIMEOUT_S = 300.0
TICK_S = 0.2  # how often the service thread fires the timers that are due (and waits for messages between)
MqttVersion = Literal["auto", "5", "3.1.1"]


def _names(value: Sequence[str] | None) -> tuple[str, ...] | None:
    return None if value is None else tuple(value)


@dataclass(frozen=True)
class Federation:
    """What the server runs. `expected_clients`: the devices that must all join before round 1 (a simulation's;
    None: `--min-clients` of anyone admitted); `limits`: the decoder's (None: derived from the config and the
    initial model); `policy`: clipping and robust aggregation (None: the defaults)."""

    cfg: FederationConfig
    fed: str = "default"
    public: PublicSet | None = None
    initial_params: np.ndarray | None = field(default=None, compare=False)
    expected_clients: Sequence[str] | None = None
    limits: Limits | None = None
    policy: ClipPolicy | None = None
    offline_grace: float = OFFLINE_GRACE_S
    validation: Validation | None = field(default=None, compare=False)
    # The per-channel mean/std of the server's data (--public-data, else --validation), recorded in the deployable
    # artifacts: how the global model (FedAvg's) and the predictor were scored here, and what export defaults to.
    norm: tuple[tuple[float, ...], tuple[float, ...]] | None = None
    # A simulation's links run this many times faster than the deadline the server is given: the selection's
    # deadline estimates (broker_server/core/selection.py) are in the profiles' time.
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "expected_clients", _names(self.expected_clients))
        if not self.offline_grace >= 0:
            raise ConfigError(f"--offline-grace must be >= 0 seconds, got {self.offline_grace}")


@dataclass(frozen=True, eq=False)
class Validation:
    """The server's own labelled data for scoring the federation's deployable model every round (`start
    --validation`): the global predictor's head on the shared backbone's features of it (computed once by the torch
    side: the backbone never changes), or, where the preset federates the whole model (FedAvg), that model's
    predictions from `scorer` (a torch child process, broker_server/ops/model_scorer.py); labels; what it is in
    words."""

    features: np.ndarray | None  # (n, d) float32: the shared backbone's features; None where `scorer` scores
    labels: np.ndarray  # (n,) int
    what: str
    scorer: Callable[[np.ndarray], np.ndarray | None] | None = None  # a parameter vector -> class per image
    # The features of the same images under another whole-model vector (the ridge predictor's opt-in route refreshes
    # the backbone every round): the torch side in a child process (start_cli); None: the backbone never changes.
    embed: Callable[[np.ndarray], np.ndarray] | None = None
    _seen: dict[str, Any] = field(default_factory=dict, repr=False)  # the refreshed backbone's features, by checksum

    def predictions(self, model: ServerModel) -> np.ndarray | None:
        """The deployable model's class per image for the server's current state (None: none yet, or no data)."""
        if len(self.labels) == 0:
            return None
        if self.features is not None:
            head = model.rules.predictor_head()
            if head is None:
                return None
            w, b = head
            return np.argmax(self._features(model.rules.predictor_backbone()) @ w.T + b, axis=1)
        params = model.rules.round_fields(Phase.DONE).params  # the global model, as the final round message has it
        return None if params is None or self.scorer is None else self.scorer(params)

    def _features(self, backbone: np.ndarray | None) -> np.ndarray:
        """The shared backbone's features, or those of `backbone` where the predictor refreshed it."""
        assert self.features is not None
        if backbone is None or self.embed is None:
            return self.features
        key = zlib.crc32(np.ascontiguousarray(backbone, np.float32).tobytes())
        if self._seen.get("key") != key:
            self._seen.update(key=key, features=self.embed(backbone))
        features: np.ndarray = self._seen["features"]
        return features

    def score(self, model: ServerModel) -> tuple[float | None, str | None]:
        """(accuracy, the collapse note of protofl/learning.py or None) of the deployable model on this data."""
        pred = self.predictions(model)
        if pred is None:
            return None, None
        return float(np.mean(pred == self.labels)), learning.collapse(pred.tolist(), self.labels.tolist())


@dataclass(frozen=True)
class Admission:
    """Who may take part: `members` (join credentials or --allow; None: anyone who reaches the broker) and at
    most `max_clients` of them at once (None: no cap)."""

    members: Sequence[str] | None = None
    max_clients: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "members", _names(self.members))
        if self.max_clients is not None and self.max_clients < 1:
            raise ConfigError(f"--max-clients must be at least 1, got {self.max_clients}")


@dataclass(frozen=True)
class Durability:
    """`--state-dir`: the aggregator's journal and checkpoint live in state_dir/aggregator (None: in memory only).
    `group_commit`: one fsync per batch of uploads the transport pumps, before any of it is acknowledged."""

    state_dir: Path | None = None
    fsync: bool = True
    group_commit: bool = True

    def __post_init__(self) -> None:
        if self.state_dir is not None:
            object.__setattr__(self, "state_dir", Path(self.state_dir))
            if self.state_dir.exists() and not self.state_dir.is_dir():
                raise ConfigError(
                    f"--state-dir {self.state_dir} is a file; it takes a directory (created if "
                    f"missing), where the federation keeps its journal, checkpoint, broker files and "
                    f"credentials"
                )

    @property
    def enabled(self) -> bool:
        return self.state_dir is not None


@dataclass(frozen=True)
class Sharding:
    """`--shards N` / `--sites NAME,...`: the uploads folded by N shard processes and pre-aggregated sites, merged
    by the coordinator at each close (docs/design.md, "Sharded aggregators"). `spawn` and `credentials` are
    `start`'s: run the shards as its children, and the credentials files they use with --broker."""

    shards: int = 0
    sites: Sequence[str] = ()
    timeout: float = DEFAULT_SHARD_TIMEOUT_S  # --shard-timeout: how long a closing phase waits for a shard's partial
    spawn: bool = True
    credentials: Path | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "sites", tuple(self.sites))
        if self.shards < 0:
            raise ConfigError(f"--shards must be >= 0, got {self.shards}")
        if not self.timeout > 0:
            raise ConfigError(f"--shard-timeout must be > 0 seconds, got {self.timeout}")

    @property
    def active(self) -> bool:
        """Whether a coordinator merges partials (shards, sites or both)."""
        return bool(self.shards or self.sites)


@dataclass(frozen=True)
class Pacing:
    """The service thread: it fires due timers every `tick` seconds (waiting for messages between), a closed
    round's line waits `log_grace` seconds for its metrics, and at most `resend_window` re-send requests are
    outstanding (None: sized from the default broker queue, capacity.resend_window)."""

    tick: float = TICK_S
    log_grace: float = GRACE_S
    resend_window: int | None = None

    def __post_init__(self) -> None:
        if not self.tick > 0 or not self.log_grace >= 0:
            raise ConfigError(
                f"the service's tick must be > 0 and its log grace >= 0 seconds, got {self.tick} and {self.log_grace}"
            )
        if self.resend_window is not None and self.resend_window < 1:
            raise ConfigError(f"the re-send window must be at least 1 request, got {self.resend_window}")


@dataclass(frozen=True)
class Watchers:
    """What watches the server (`start --metrics-port/--ui-port`): the board the HTTP servers read (None: one of
    the service's own), the Prometheus metrics it observes, the restarts of a broker `start` supervises, and a
    fleet run's view of the fleet's privacy ledger (broker_server/ops/privacy_ledger.py)."""

    board: SnapshotBoard | None = None
    metrics: FederationMetrics | None = None
    broker_restarts: Callable[[], int] | None = None
    fleet_privacy: FleetView | None = None


@dataclass(frozen=True)
class Hooks:
    """What the embedding code is told, on the service thread: a round closed (also one a journal replay closes
    again), a device's metrics came in, a round's line went out (with its accuracies and how many reported)."""

    on_round_end: Callable[[RoundRecord], None] | None = None
    on_metrics: Callable[[str, int, Metrics, int], None] | None = None
    on_round_logged: Callable[[RoundRecord, dict[str, float | None], int], None] | None = None


@dataclass(frozen=True)
class Broker:
    """The broker connection a service's transport is built from: where and as whom (`options`: URL, credentials,
    TLS), the MQTT version, the client id (None: the service's default), how long to wait for it at start, and how
    many messages it holds for the server beyond those in flight (mosquitto's max_queued_messages)."""

    options: BrokerOptions
    protocol: MqttVersion = "auto"
    client_id: str | None = None
    connect_timeout: float = CONNECT_TIMEOUT_S
    queue: int = DEFAULT_QUEUE

    def __post_init__(self) -> None:
        if self.protocol not in ("auto", "5", "3.1.1"):
            raise ConfigError(f"the MQTT protocol must be auto, 5 or 3.1.1, got '{self.protocol}'")
        if not self.connect_timeout > 0:
            raise ConfigError(f"--connect-timeout must be > 0 seconds, got {self.connect_timeout}")
        if self.queue < 1:
            raise ConfigError(f"--broker-queue must be at least 1 message, got {self.queue}")


@dataclass(frozen=True)
class ShardSettings:
    """One aggregator shard: shard `index` on the core broker, or the pre-aggregator of `site` on that site's
    broker; its journal and open phase in `state_dir`; the coordinator's --shard-timeout."""

    fed: str
    state_dir: Path
    index: int | None = None
    site: str | None = None
    fsync: bool = True
    timeout: float = DEFAULT_SHARD_TIMEOUT_S

    def __post_init__(self) -> None:
        object.__setattr__(self, "state_dir", Path(self.state_dir))
        if (self.index is None) == (self.site is None):
            raise ConfigError(
                "a shard is either --index I (on the core broker) or --site NAME (a site's "
                "pre-aggregator, on the site broker)"
            )
        if self.index is not None and self.index < 0:
            raise ConfigError(f"--index must be >= 0, got {self.index}")
        if not self.timeout > 0:
            raise ConfigError(f"--shard-timeout must be > 0 seconds, got {self.timeout}")

    @property
    def name(self) -> str:
        """The shard's name in the coordinator's messages: shard-I, or site-NAME."""
        from broker_server.ops.security import shard_id, site_shard

        return shard_id(self.index) if self.index is not None else site_shard(str(self.site))

    @property
    def user(self) -> str:
        """Its MQTT user name (and client id: a restarted shard takes up its session)."""
        from broker_server.ops.security import shard_user, site_aggregator_user

        return (
            shard_user(self.fed, self.index)
            if self.index is not None
            else site_aggregator_user(self.fed, str(self.site))
        )

    @property
    def session_expiry(self) -> int:
        """How long the broker keeps its session while it is gone: a core shard's, its --shard-timeout (then the
        other shards get every upload); a site's pre-aggregator, the site broker's only reader, a device's hour."""
        return max(1, math.ceil(self.timeout)) if self.index is not None else DEFAULT_SESSION_EXPIRY_S
