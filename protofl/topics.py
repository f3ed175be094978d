"""Topic names under `protofl/{fed}/` (docs/design.md, wire protocol v1)."""

from __future__ import annotations

ROOT = "protofl"
SERVER_ID = "server"  # the sender of every message the server publishes


def config(fed: str) -> str:
    return f"{ROOT}/{fed}/config"


def public(fed: str) -> str:
    return f"{ROOT}/{fed}/public"


def round_(fed: str) -> str:
    return f"{ROOT}/{fed}/round"


def up(fed: str, client_id: str) -> str:
    return f"{ROOT}/{fed}/up/{client_id}"


def up_all(fed: str) -> str:
    return f"{ROOT}/{fed}/up/+"


def down(fed: str, client_id: str) -> str:
    """One device's own inbox: the server's re-send requests (only the server may write it: the ACL)."""
    return f"{ROOT}/{fed}/down/{client_id}"


def presence(fed: str, client_id: str) -> str:
    return f"{ROOT}/{fed}/presence/{client_id}"


def presence_all(fed: str) -> str:
    return f"{ROOT}/{fed}/presence/+"


def server_status(fed: str) -> str:
    return f"{ROOT}/{fed}/server/status"


def fleet(fed: str) -> str:
    """A fleet's current run (retained Status: state "run" with the run's name as detail, or "idle"): a device of
    a fleet waits for the next run when one ends instead of leaving (broker_server/fleet/fleet.py)."""
    return f"{ROOT}/{fed}/server/fleet"


# How a device of a fleet's presence detail begins when it cannot serve the current run ("cannot serve run 'NAME':
# why"): the run's server logs it for a member that never joined (broker_server/core/shell.py).
CANNOT_SERVE = "cannot serve run"
# ... and a device outside a fleet that cannot take part in the federation, before it leaves ("cannot join
# federation 'FED': why"): the server counts and logs both as the member's refusal.
CANNOT_JOIN = "cannot join federation"
CANNOT_SERVE_PREFIXES = (CANNOT_SERVE, CANNOT_JOIN)


def device_log(fed: str, client_id: str) -> str:
    """One device's log lines, shipped to the server (edge_agent/ops/log_ship.py, broker_server/ops/device_logs.py)."""
    return f"{ROOT}/{fed}/log/{client_id}"


def server_summary(fed: str) -> str:
    """The server's retained summary for watchers (JSON, not the device wire format: docs/design.md)."""
    return f"{ROOT}/{fed}/server/summary"


def site_dropped(fed: str, site: str) -> str:
    """Site broker `site`'s dropped-messages counter (its `$SYS/broker/publish/messages/dropped`), carried
    to the core by its bridge (broker_server/scaleout/bridge.py) for the server to read as it reads its own broker's."""
    return f"{ROOT}/{fed}/sites/{site}/dropped"


def site_dropped_all(fed: str) -> str:
    return f"{ROOT}/{fed}/sites/+/dropped"


# Sharded aggregators (docs/design.md, "Scale-out"): the shards share the uploads through one MQTT 5 shared
# subscription; the coordinator and the shards talk under `shards/` (versioned msgpack, their own ACL).
def shared_up(fed: str) -> str:
    return f"$share/protofl-{fed}/{up_all(fed)}"


def shards(fed: str, what: str, who: str = "") -> str:
    """`shards/phase` and `shards/close` (coordinator -> shards, retained), `shards/progress/<shard>`,
    `shards/partial/<shard>`, `shards/hello/<shard>` and `shards/gone/<shard>` (shard -> coordinator; gone is
    its will) and `shards/relay/<client>` (a device's join or metrics a shard received, passed on as it came)."""
    return f"{ROOT}/{fed}/shards/{what}" + (f"/{who}" if who else "")


def client_of(topic: str) -> str:
    """The client id in an `up/{client_id}` or `presence/{client_id}` topic ("" if none)."""
    parts = topic.split("/")
    return parts[3] if len(parts) == 4 and parts[2] in ("up", "presence") else ""


def is_presence(topic: str) -> bool:
    parts = topic.split("/")
    return len(parts) == 4 and parts[2] == "presence"
