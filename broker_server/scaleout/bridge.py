"""A site broker: a Mosquitto that the devices at one site connect to, bridged to the federation's core broker.

`protofl-server broker-config --bridge SITE` writes its files (docs/design.md "Scale-out"). The core side
gets a bridge user of its own (security.bridge_user) in the federation's credentials, whose ACL lets it
write uploads and presence of any device and read what devices read, nothing else; the site's devices are
added to the federation (the server takes them as members). The site side gets:

- `mosquitto.conf`: the site's listener (TLS with a certificate the federation CA signs, by default beyond
  loopback, so a device's credentials file verifies the site broker as it verifies the core), its password
  file and ACL, and one bridge connection to the core: MQTT 3.1.1 with `try_private` (Mosquitto to
  Mosquitto: retained messages keep their flag both ways), a persistent session (`cleansession false`:
  the core queues round messages for the bridge while the link is down, the site queues uploads), TLS to
  the core with the federation CA when the core serves TLS. Topics: `up/+` and `presence/+` out (joins,
  uploads, metrics and presence, retained flags kept), `config`, `public`, `round`, `server/status` and
  `down/+` (the server's re-send requests to one device: broker_server/ops/resend.py) in, and the site's own
  dropped-messages counter up as `sites/<site>/dropped` (`drops_line`), for the server to see the site's drops.
  A device that vanishes at the site gets its will published by the site broker on `presence/<id>`, which
  the bridge carries to the server like any presence message. The file holds the bridge's password: 0600.
- `passwd` and `acl`: the site's devices only, with the same per-device rights as on the core.
- `devices/<id>.json`: each site device's credentials file (the federation CA when the site serves TLS).
- `core-ca.crt` (TLS to the core) and `tls/` (the site's own listener).

With `--pre-aggregate` the site folds its own uploads: the site broker also gets the user of a site
pre-aggregator (`protofl-server shard --site SITE`, credentials in `site-aggregator.json`) with a shard's rights
there, the bridge carries that pre-aggregator's progress, partials and relayed joins up and the coordinator's
phase and close messages down (broker_server/scaleout/site.py), `up/+` stays at the site, and the core's ACL gives the
bridge user those topics instead of the uploads. The core then runs `start --sites SITE`.

What the bridge does not do: a site broker that dies leaves its devices' last presence on the core (their
wills die with it); the server's round deadline and offline grace still close rounds without them.
"""

from __future__ import annotations

import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from broker_server.ops.broker import DROPPED_TOPIC, MOSQUITTO_USER, PACKET_HEADROOM, ListenerTls, MosquittoBroker
from broker_server.ops.security import (
    BrokerAuth,
    device_acl_lines,
    password_lines,
    prepare,
    site_aggregator_user,
    write_secret,
)
from broker_server.scaleout.site import bridge_topics as site_bridge_topics
from broker_server.scaleout.site import site_aggregator_acl
from protofl import topics
from protofl.errors import ConfigError
from protofl.names import check_name
from protofl.transport.broker_url import BrokerOptions, parse_broker_url
from protofl.transport.credentials import Credentials, device_file_text
from protofl.wire import Limits


def bridge_topics(fed: str) -> list[str]:
    """The bridge's topic lines: what devices publish goes up, what the server publishes comes down (QoS 1).
    The site broker's ACL still decides which device reads which `down/<id>`."""
    up = [topics.up(fed, "+"), topics.presence(fed, "+")]
    down = [
        topics.config(fed),
        topics.public(fed),
        topics.round_(fed),
        topics.server_status(fed),
        topics.down(fed, "+"),
    ]
    return [f"topic {t} out 1" for t in up] + [f"topic {t} in 1" for t in down]


def bridge_lines(
    fed: str, site: str, core: BrokerOptions, cred: Credentials, core_ca: Path | None, pre_aggregate: bool = False
) -> list[str]:
    """The `connection` block of the site broker's config (mosquitto.conf(5), "Bridges"); with `pre_aggregate`
    its topics are the site pre-aggregator's (broker_server/scaleout/site.py), and the uploads stay at the site."""
    host = f"[{core.host}]" if ":" in core.host else core.host
    lines = [
        f"# the bridge to the core broker of federation '{fed}' (protofl-server broker-config --bridge {site})",
        f"connection protofl-{fed}-{site}",
        f"address {host}:{core.port}",
        "bridge_protocol_version mqttv311",
        "try_private true",  # tells the core it is a bridge: retained flags kept, no loops
        # The core's broker replaces client ids by user names; one bridge session per site, kept across drops.
        f"remote_clientid {cred.username}",
        f"remote_username {cred.username}",
        f"remote_password {cred.password}",
        "cleansession false",
        # $SYS/broker/connection/... on the site only: the core's ACL lets the bridge write nothing there.
        "notifications true",
        "notifications_local_only true",
        "keepalive_interval 30",
        "restart_timeout 1 30",
        "start_type automatic",
    ]
    if core_ca is not None:
        lines.append(f"bridge_cafile {core_ca}")
    return lines + (site_bridge_topics(fed, site) if pre_aggregate else bridge_topics(fed)) + [drops_line(fed, site)]


def drops_line(fed: str, site: str) -> str:
    """The site broker's dropped-messages counter, up to the core as `sites/<site>/dropped`: the server reads
    it as it reads its own broker's and asks the devices that owe the phase to send again (resend.py)."""
    local, name = DROPPED_TOPIC.rsplit("/", 1)
    remote = topics.site_dropped(fed, site)
    assert remote.endswith("/" + name)
    return f"topic {name} out 1 {local}/ {remote[: -len(name)]}"


@dataclass(frozen=True)
class SiteBroker:
    """What `write_site_broker` wrote: the site broker (configured, not started) and the core's credentials."""

    broker: MosquittoBroker
    core_auth: BrokerAuth
    site: str
    devices: tuple[str, ...]
    core_tls: bool
    site_tls: bool
    core_cert_renewed: bool  # the core's certificate was signed again to hold the core's host name
    pre_aggregated: bool = False  # a site pre-aggregator folds the uploads here (its file: aggregator_file)

    @property
    def directory(self) -> Path:
        return self.broker.workdir

    def device_file(self, client_id: str) -> Path:
        return self.directory / "devices" / f"{client_id}.json"

    @property
    def aggregator_file(self) -> Path:
        """The site pre-aggregator's credentials (`protofl-server shard --site SITE --credentials FILE`)."""
        return self.directory / "site-aggregator.json"


def parse_core_url(url: str) -> BrokerOptions:
    core = parse_broker_url(url)
    if core.unix_path is not None:
        raise ConfigError(
            f"--core {url}: a site broker reaches the core over the network; give mqtt://HOST:PORT "
            f"or mqtts://HOST:PORT (the address the site uses for the core's broker)"
        )
    return core


def _site_owner(out: Path) -> tuple[int, int] | None:
    """Run as root: the uid and gid of the user the site's mosquitto drops to (it then reads its files and
    writes its persistence as that user); None otherwise (the site broker runs as whoever wrote it)."""
    if os.geteuid() != 0:
        return None
    import pwd

    try:
        found = pwd.getpwnam(MOSQUITTO_USER)
    except KeyError:
        raise ConfigError(
            f"broker-config --bridge as root: the site broker drops to user '{MOSQUITTO_USER}', and there is "
            f"none here (install Mosquitto's package, which creates it, or run broker-config as the user "
            f"that will run the site broker)"
        ) from None
    owner = found.pw_uid, found.pw_gid
    for parent in out.resolve().parents:
        if parent.exists() and not _enters(parent, *owner):
            raise ConfigError(
                f"--out {out}: the site broker runs as user '{MOSQUITTO_USER}' (broker-config runs as root), "
                f"who cannot enter {parent}; pick a directory it can reach (e.g. under /etc/mosquitto) or let "
                f"it enter that one (chmod o+x)"
            )
    return owner


def _enters(path: Path, uid: int, gid: int) -> bool:
    st = path.stat()
    if st.st_uid == uid:
        return bool(st.st_mode & stat.S_IXUSR)
    if st.st_gid == gid:
        return bool(st.st_mode & stat.S_IXGRP)
    return bool(st.st_mode & stat.S_IXOTH)


def _hand_over(out: Path, owner: tuple[int, int]) -> None:
    """The site broker's own files to its user (the devices' credential files stay root's)."""
    keep = {out / "devices", out / "site-aggregator.json"}
    os.chown(out, *owner)
    for path in out.rglob("*"):
        if not any(path == k or k in path.parents for k in keep):
            os.chown(path, *owner)


def write_site_broker(
    core_dir: Path,
    out: Path,
    fed: str,
    site: str,
    core_url: str,
    device_ids: list[str],
    listen: tuple[str, int],
    tls: bool,
    core_ca: Path | None = None,
    max_packet_size: int | None = None,
    queue: int | None = None,
    pre_aggregate: bool = False,
) -> SiteBroker:
    """Add site `site` and its devices to the federation's credentials in `core_dir` (the core's security
    directory: STATE/security of `protofl-server start`, or a `broker-config --out`), and write the site
    broker's files in `out`. `tls`: the site's listener serves TLS signed by the federation CA. `queue`: what
    the site broker holds for its bridge while the core is slow or unreachable (default: from its devices, as
    the core's queue for the aggregator is sized from the fleet). `pre_aggregate`: a site pre-aggregator
    (`protofl-server shard --site SITE`, its credentials in site-aggregator.json) folds the site's uploads on
    the site broker, and the bridge carries its progress and partials instead of the uploads
    (broker_server/scaleout/site.py)."""
    from broker_server.ops import pki
    from broker_server.ops.capacity import queue_for_fleet

    check_name(site, "--bridge site name")
    owner = _site_owner(out)
    core = parse_core_url(core_url)
    if not device_ids:
        raise ConfigError("a site broker needs its devices: --allow FILE (one id a line) or --devices N")
    if out.resolve() == core_dir.resolve():
        raise ConfigError(
            f"--out {out} is the core's directory (--core-dir); the site broker's files go in a directory of their own"
        )
    if core_ca is not None and not core_ca.is_file():
        raise ConfigError(f"--core-ca {core_ca}: no such file")
    # prepare checks the federation before anything else is written
    auth = prepare(core_dir, fed, device_ids, sites=[site], pre_aggregate=pre_aggregate)
    # Which devices connect through this site: the core's start sizes its queue for them, not its open files.
    auth.secrets.site_devices[site] = sorted(set(device_ids))
    fed_tls = pki.FederationTls(core_dir / "tls")
    renewed = False
    if core.tls and core_ca is None:
        # The core serves the federation's generated CA (start's default beyond loopback): the bridge checks the
        # core's certificate against it, and Mosquitto matches the host name, so the certificate must hold it.
        names = pki.certificate_names(fed_tls.broker_cert)
        if core.host not in names:
            pki.ensure_federation_tls(fed_tls.directory, fed, [*sorted(names), *pki.broker_names(core.host)])
            renewed = bool(names)
        core_ca = fed_tls.ca_cert
    # The core's own device files as `start` writes them (with the CA when the core serves the generated one).
    auth.provision(fed_tls.ca_pem() if core.tls and core_ca == fed_tls.ca_cert else None)
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    ca_copy = None
    if core_ca is not None:
        ca_copy = out / "core-ca.crt"
        shutil.copyfile(core_ca, ca_copy)
    host, port = listen
    listener: ListenerTls | None = None
    site_ca_pem = None
    if tls:
        site_tls = pki.ensure_site_tls(fed_tls, out / "tls", fed, pki.broker_names(host))
        listener, site_ca_pem = site_tls.listener(), site_tls.ca_pem()
    secrets = auth.secrets
    creds = [secrets.device(i) for i in sorted(set(device_ids))]
    acl = device_acl_lines(fed)
    users = list(creds)
    aggregator = out / "site-aggregator.json"
    if pre_aggregate:
        me = Credentials(site_aggregator_user(fed, site), secrets.pre_aggregators[site])
        users.append(me)
        acl += [
            "",
            f"# the site's pre-aggregator (protofl-server shard --site {site}): it folds the uploads here",
            *site_aggregator_acl(fed, site),
        ]
        write_secret(aggregator, device_file_text(me, fed, site_ca_pem))
    else:
        aggregator.unlink(missing_ok=True)  # a site that forwards its uploads has no pre-aggregator
    write_secret(out / "passwd", password_lines(users))
    (out / "acl").write_text("\n".join(acl))
    (out / "devices").mkdir(exist_ok=True)
    for c in creds:
        write_secret(out / "devices" / f"{c.username}.json", device_file_text(c, fed, site_ca_pem))
    auth_lines = [
        "allow_anonymous false",
        f"password_file {out / 'passwd'}",
        f"acl_file {out / 'acl'}",
        "use_username_as_clientid true",
    ]
    packet = max_packet_size or Limits().max_message_bytes + PACKET_HEADROOM
    broker = MosquittoBroker(
        host,
        port,
        workdir=out,
        max_packet_size=packet,
        allow_anonymous=False,
        max_queued_messages=queue or queue_for_fleet(len(creds), 2),
        tls=listener,
        drop_root=True,
        extra_config=[line for line in auth_lines if not line.startswith("allow_anonymous")]
        + bridge_lines(fed, site, core, secrets.bridge(site), ca_copy, pre_aggregate),
    )
    broker.write_config()
    os.chmod(broker.config_path, 0o600)  # it holds the bridge's password
    if owner is not None:
        _hand_over(out, owner)
    return SiteBroker(broker, auth, site, tuple(c.username for c in creds), core.tls, tls, renewed, pre_aggregate)
