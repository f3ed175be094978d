"""A pre-aggregated site (docs/design.md, "Scale-out"): the devices at a site connect to a site broker bridged
to the core (broker_server/scaleout/bridge.py, `broker-config --bridge`), and a site pre-aggregator - an aggregator
shard
named `site-<name>`, `protofl-server shard --site NAME` against the site broker - folds their uploads there.
Over the site's backhaul then go its progress (one message per batch of uploads), one partial per phase, the
joins and metrics it relays, and presence; not the uploads. The coordinator (`start --sites NAME,...`) counts
the site as one of its shards. What the bridge and the two ACLs must say is written here, once."""

from __future__ import annotations

from broker_server.ops.security import shard_user_acl, site_aggregator_user, site_shard
from protofl import topics


def bridge_topics(fed: str, site: str) -> list[str]:
    """The site bridge's `topic` lines with a pre-aggregator: device presence and the pre-aggregator's messages
    out, what the server publishes (the coordinator's phase and close too) in; `up/+` stays at the site."""
    me = site_shard(site)
    out = [
        topics.presence(fed, "+"),
        topics.shards(fed, "progress", me),
        topics.shards(fed, "partial", me),
        topics.shards(fed, "hello", me),
        topics.shards(fed, "relay", "+"),
    ]
    down = [
        topics.config(fed),
        topics.public(fed),
        topics.round_(fed),
        topics.server_status(fed),
        topics.shards(fed, "phase"),
        topics.shards(fed, "close"),
        topics.down(fed, "+"),
    ]
    return [f"topic {t} out 1" for t in out] + [f"topic {t} in 1" for t in down]


def site_aggregator_acl(fed: str, site: str) -> list[str]:
    """The pre-aggregator's lines in the site broker's ACL: a shard's rights there."""
    return shard_user_acl(fed, site_aggregator_user(fed, site), site_shard(site))
