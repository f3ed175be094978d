"""`simulate --profiles`: one shaping proxy per simulated device, and a watcher of what reaches the broker.

Client i gets the i-th device of the fleet (classes in the order given, `rpi4+lte:4` = four in a
row) and its own `LinkProxy` in front of the broker, so its MQTT connection crosses its link. The
`UploadWatcher` listens on `up/+` straight at the broker (no proxy): when each upload arrived, how
big it was and how it was encoded; with the devices' own timings (their metrics' `extra`), that is
the per-device per-round timeline of the report (`broker_server.simulation.timeline`). numpy only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import Any

from protofl import topics
from protofl.errors import ConfigError, WireError
from protofl.profiles import DeviceClass, LinkProfile
from protofl.transport.broker_url import BrokerOptions
from protofl.transport.link_proxy import LinkProxy, LinkShape
from protofl.transport.mqtt import MqttTransport
from protofl.wire import unpack_envelope

UPLOADS = ("protos", "adapter")


def expand(fleet: list[DeviceClass], clients: int | None) -> list[DeviceClass]:
    """One device class per client, in fleet order; `clients` (if given) must match the fleet's size."""
    per_client = [dataclasses.replace(c, count=1) for c in fleet for _ in range(c.count)]
    if clients is not None and clients != len(per_client):
        raise ConfigError(
            f"--clients {clients} but --profiles describes {len(per_client)} devices; "
            f"leave --clients out or make the counts add up"
        )
    return per_client


def link_shape(link: LinkProfile) -> LinkShape:
    return LinkShape(
        up_bytes_per_s=link.uplink_bytes_per_s,
        down_bytes_per_s=link.downlink_bytes_per_s,
        rtt_s=link.rtt_ms / 1000,
        jitter_s=link.jitter_ms / 1000,
        down_at=link.outage.down_at if link.outage is not None else None,
    )


class Links:
    """The proxies of a fleet, started together (their simulated clocks share one origin)."""

    def __init__(
        self, devices: list[DeviceClass], broker: BrokerOptions, time_scale: float, seed: int, largest_message: int = 0
    ) -> None:
        if broker.tls:
            raise ConfigError("--profiles shapes plain TCP to a local broker; it cannot be combined with mqtts://")
        self.devices = devices
        self.broker = broker
        self.time_scale = time_scale
        self.largest_message = largest_message
        self.proxies = [
            LinkProxy(
                (broker.host, broker.port),
                link_shape(d.link),
                time_scale=time_scale,
                seed=seed * 1000 + i,
                name=f"link-{i:03d}-{d.link.name}",
            )
            for i, d in enumerate(devices)
        ]

    def start(self) -> Links:
        for p in self.proxies:
            p.start()
        return self

    def broker_for(self, index: int) -> BrokerOptions:
        """The broker as client `index` sees it: its own proxy."""
        p = self.proxies[index]
        return dataclasses.replace(self.broker, host=p.host, port=p.port, keepalive=self.keepalive(index))

    def keepalive(self, index: int) -> int:
        """MQTT keepalive (real s) of client `index`: it must outlast the largest message's transfer.

        paho counts a packet as activity only once it is complete, so while FedAvg's 6.8 MB round
        message crawls down an NB-IoT link (~2000 s) a 30 s keepalive expires, the client drops the
        connection and the retained message starts again from its first byte. A field device on
        such a link needs the same: a keepalive longer than its longest transfer."""
        link = self.devices[index].link
        transfer = self.largest_message / min(link.downlink_bytes_per_s, link.uplink_bytes_per_s) / self.time_scale
        return max(self.broker.keepalive, min(65535, int(2 * transfer) + 1))

    def stats(self) -> list[dict[str, Any]]:
        return [
            {
                "up_bytes": p.stats.up.bytes,
                "down_bytes": p.stats.down.bytes,
                "connections": p.stats.connections,
                "cuts": p.stats.cuts,
                "refused": p.stats.refused,
            }
            for p in self.proxies
        ]

    def close(self) -> None:
        for p in self.proxies:
            p.close()


@dataclass
class Arrival:
    sender: str
    round: int
    phase: str
    kind: str
    nbytes: int
    t: float  # epoch seconds at the broker
    dt: str | None = None
    k: int | None = None  # APUD: coordinates sent


def _encoding(kind: str, body: Any) -> tuple[str | None, int | None]:
    """(wire dtype, sparse K) of an upload body, read from the raw map; (None, None) if unreadable."""
    with contextlib.suppress(KeyError, TypeError, AttributeError):
        if kind == "adapter":
            u = body["update"]
            if "n" in u:  # sparse: {n, i | mask, v}
                v = u["v"]
                return v["dt"], int(v["sh"][0])
            return u["dt"], None
        if kind == "protos":
            return body["local"]["v"]["dt"], None
    return None, None


class UploadWatcher:
    """Records every upload as it reaches the broker: a second handler on the aggregator's own connection
    (direct, not through a proxy; and the only user the generated ACL lets read uploads: a connection of
    its own with the server's user name would take the aggregator's session over), timed when the message
    came off the wire, not when the aggregator got to it."""

    def __init__(self, transport: MqttTransport, fed: str) -> None:
        self.arrivals: list[Arrival] = []
        self._lock = threading.Lock()
        self.transport = transport
        self.fed = fed

    def start(self) -> UploadWatcher:
        self.transport.subscribe(topics.up_all(self.fed), self._on)
        return self

    def _on(self, topic: str, payload: bytes) -> None:
        t = self.transport.arrived.get(topic, time.time())
        try:
            env = unpack_envelope(payload)
        except WireError:
            return
        if env.kind not in UPLOADS:
            return
        dt, k = _encoding(env.kind, env.body)
        with self._lock:
            self.arrivals.append(Arrival(env.sender, env.round, env.phase, env.kind, len(payload), t, dt, k))

    def close(self) -> None:
        """Nothing to release: the connection is the aggregator's."""
