"""Per-federation credentials and the broker files that enforce them (docs/design.md "Security").

One federation has a server identity, a monitor identity and one user per device (user name = device
id). The broker enforces the trust boundary with a password file and an ACL generated here:
- the server (`protofl-server-{fed}`) reads and writes everything under `protofl/{fed}/`, and reads the
  broker's `$SYS/broker/publish/messages/dropped` counter (broker_server/ops/resend.py);
- a device writes only `up/<its id>` and `presence/<its id>` and reads `config`, `public`, `round`,
  `server/status` and its own `down/<its id>` (the server's re-send requests); nobody else reads `up/#`;
- the monitor (`protofl-monitor-{fed}`, for `protofl-server status --broker`) reads `server/status`
  and `server/summary` and nothing else, and writes nothing: its own deny lines come before the
  patterns every user gets (Mosquitto checks a user's deny entries first). Its user name is no
  device's, so with `use_username_as_clientid` it never takes a device's session.
Since only user X may publish on `up/X`, the topic's client id is authenticated, and the aggregator's
"topic id == sender" check then means the sender is who it says it is.

Files (all under one directory, secrets 0600): `credentials.json` (the plain secrets, reused across
restarts), `passwd` (Mosquitto's PBKDF2-SHA512 hashes, the format `mosquitto_passwd` writes), `acl`,
`monitor.json` (the monitor's file, in the devices' format) and `devices/<id>.json`, one provisioning
file per device for `protofl-edge join --credentials` (with
the federation CA's certificate when the broker serves TLS with it: broker_server/ops/pki.py).
`prepare` writes what the broker reads (passwd, acl); `BrokerAuth.provision` the plain secrets, which
`protofl-server start` does only once its broker is listening, so a start that fails hands out nothing.
A restart keeps what exists: the hashes of users already in `passwd` (credentials.json, their source,
never changes a password; the server's and monitor's hashes are verified as a check that the two files
belong together, else every user is hashed again), and the device files already written with the same
CA (monitor.json, written with it, tells). Only new devices cost a hash and a file: at 10,000 devices a
restart no longer re-hashes and rewrites all of them.
No third-party packages: hashing is hashlib, secrets come from `secrets`.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from broker_server.ops.broker import DROPPED_TOPIC
from protofl import topics
from protofl.errors import ConfigError
from protofl.names import check_name
from protofl.transport.credentials import Credentials, device_file_text

PASSWORD_BYTES = 24  # 192 bits of entropy, 32 url-safe characters
PBKDF2_ITERATIONS = 101  # what mosquitto_passwd 2.0 writes; the broker reads the count from the hash


def server_user(fed: str) -> str:
    """The aggregator's MQTT user name (and client id: the broker sets client id = user name)."""
    return f"protofl-server-{fed}"


def monitor_user(fed: str) -> str:
    """The read-only watcher's MQTT user name (`protofl-server status --broker`)."""
    return f"protofl-monitor-{fed}"


def bridge_user(fed: str, site: str) -> str:
    """The MQTT user a site broker's bridge logs in to the core broker as (broker_server/scaleout/bridge.py)."""
    return f"protofl-bridge-{fed}-{site}"


def site_shard(site: str) -> str:
    """The shard id of site `site`'s pre-aggregator (a shard at the site broker, its traffic bridged)."""
    return f"site-{check_name(site, 'site')}"


def shard_id(index: int) -> str:
    """Aggregator shard `index`'s id in the coordinator's messages (a site's pre-aggregator: `site_shard`)."""
    return f"shard-{index}"


def site_aggregator_user(fed: str, site: str) -> str:
    """A site pre-aggregator's user (and client id) on its site broker (broker_server/scaleout/site.py)."""
    return f"protofl-site-{fed}-{site}"


def shard_user(fed: str, index: int) -> str:
    """Aggregator shard `index`'s MQTT user name (and client id): its session survives its restarts."""
    return f"protofl-shard-{fed}-{index}"


def new_password() -> str:
    return secrets.token_urlsafe(PASSWORD_BYTES)


def mosquitto_hash(password: str, salt: bytes | None = None, iterations: int = PBKDF2_ITERATIONS) -> str:
    """`$7$iterations$salt$hash`: PBKDF2-HMAC-SHA512 as in Mosquitto 2.0's password file."""
    salt = salt if salt is not None else secrets.token_bytes(12)
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations)
    return f"$7${iterations}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


@dataclass
class FederationSecrets:
    """The plain secrets of one federation: the server's password and one password per device id."""

    fed: str
    server_password: str
    devices: dict[str, str] = field(default_factory=dict)
    monitor_password: str = field(default_factory=new_password)  # a file from before the monitor gets one
    bridges: dict[str, str] = field(default_factory=dict)  # site name -> its bridge's password on the core
    site_devices: dict[str, list[str]] = field(default_factory=dict)  # site name -> the devices it serves
    shard_passwords: dict[str, str] = field(default_factory=dict)  # aggregator shards' (shard_user -> password)
    # Pre-aggregated sites (broker_server/scaleout/site.py): site name -> the password of its pre-aggregator's user on
    # the
    # site broker. Their bridges carry the pre-aggregator's messages to the core, not the uploads.
    pre_aggregators: dict[str, str] = field(default_factory=dict)

    @classmethod
    def create(cls, fed: str, device_ids: Iterable[str] = ()) -> FederationSecrets:
        out = cls(check_name(fed, "federation"), new_password())
        out.add_devices(device_ids)
        return out

    @property
    def server(self) -> Credentials:
        return Credentials(server_user(self.fed), self.server_password)

    @property
    def monitor(self) -> Credentials:
        return Credentials(monitor_user(self.fed), self.monitor_password)

    def device(self, client_id: str) -> Credentials:
        if client_id not in self.devices:
            raise ConfigError(
                f"no credentials for device '{client_id}' in federation '{self.fed}'; add it with "
                f"protofl-server broker-config --allow FILE (or --devices N)"
            )
        return Credentials(client_id, self.devices[client_id])

    def bridge(self, site: str) -> Credentials:
        return Credentials(bridge_user(self.fed, site), self.bridges[site])

    def add_bridge(self, site: str) -> Credentials:
        """The bridge credential of site broker `site` (created once, then kept: the site's config holds it)."""
        check_name(site, "site")
        user = bridge_user(self.fed, site)
        if user in self.devices:
            raise ConfigError(f"site '{site}': its bridge user '{user}' is a device id here; pick another site name")
        self.bridges.setdefault(site, new_password())
        return self.bridge(site)

    def shard(self, index: int) -> Credentials:
        return Credentials(shard_user(self.fed, index), self.shard_passwords[shard_user(self.fed, index)])

    def add_shards(self, count: int) -> None:
        """Credentials for aggregator shards 0..count-1 (existing ones are kept)."""
        for index in range(count):
            self.shard_passwords.setdefault(shard_user(self.fed, index), new_password())

    def add_devices(self, device_ids: Iterable[str]) -> list[str]:
        """Give every id without credentials a new password (existing ones are kept); returns the new ids."""
        added = []
        for client_id in device_ids:
            check_name(client_id, "device id")
            if client_id.startswith(shard_user(self.fed, 0)[:-1]):
                raise ConfigError(f"device id '{client_id}' is an aggregator shard's user name; pick another id")
            reserved = [
                ("server", server_user(self.fed)),
                ("monitor", monitor_user(self.fed)),
                *((f"site '{site}' bridge", bridge_user(self.fed, site)) for site in self.bridges),
            ]
            for who, user in reserved:
                if client_id == user:
                    raise ConfigError(f"device id '{client_id}' is the {who}'s user name; pick another id")
            if client_id not in self.devices:
                self.devices[client_id] = new_password()
                added.append(client_id)
        return added

    def to_json(self) -> str:
        return json.dumps(
            {
                "fed": self.fed,
                "server_password": self.server_password,
                "devices": self.devices,
                "monitor_password": self.monitor_password,
                "shard_passwords": self.shard_passwords,
                "bridges": self.bridges,
                "site_devices": self.site_devices,
                "pre_aggregators": self.pre_aggregators,
            },
            indent=2,
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str, where: str) -> FederationSecrets:
        try:
            raw = json.loads(text)
            out = cls(str(raw["fed"]), str(raw["server_password"]), {str(k): str(v) for k, v in raw["devices"].items()})
            if raw.get("monitor_password"):
                out.monitor_password = str(raw["monitor_password"])
            out.bridges = {str(k): str(v) for k, v in raw.get("bridges", {}).items()}
            out.site_devices = {str(k): [str(i) for i in v] for k, v in raw.get("site_devices", {}).items()}
            out.shard_passwords = {str(k): str(v) for k, v in raw.get("shard_passwords", {}).items()}
            out.pre_aggregators = {str(k): str(v) for k, v in raw.get("pre_aggregators", {}).items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(
                f"{where}: not a protofl credentials file ({exc}); remove it to generate new "
                f"credentials (every device then needs its new file)"
            ) from None
        return out


def shard_acl(fed: str, shards: int) -> list[str]:
    return [line for index in range(shards) for line in shard_user_acl(fed, shard_user(fed, index), f"shard-{index}")]


def shard_user_acl(fed: str, user: str, shard: str) -> list[str]:
    """An aggregator shard (`shard`, logged in as `user`) reads the uploads (through the shared subscription) and
    the coordinator's phase and close messages; it writes only its own progress, partial and hello, and relays
    devices' joins and metrics (and its will, `gone`)."""
    return [
        f"user {user}",
        f"topic read {topics.up(fed, '+')}",
        f"topic read {topics.shards(fed, 'phase')}",
        f"topic read {topics.shards(fed, 'close')}",
        *(f"topic write {topics.shards(fed, what, shard)}" for what in ("progress", "partial", "hello", "gone")),
        f"topic write {topics.shards(fed, 'relay', '+')}",
        "",
    ]


def device_acl_lines(fed: str) -> list[str]:
    """What every user may do (patterns apply to every user; %u is the user name): a device's rights."""
    return [
        f"# generated by protofl-edge for federation '{fed}': devices are users named by their id",
        f"pattern write {topics.up(fed, '%u')}",
        f"pattern write {topics.presence(fed, '%u')}",
        f"pattern write {topics.device_log(fed, '%u')}",
        f"pattern read {topics.config(fed)}",
        f"pattern read {topics.public(fed)}",
        f"pattern read {topics.round_(fed)}",
        f"pattern read {topics.server_status(fed)}",
        f"pattern read {topics.fleet(fed)}",
        f"pattern read {topics.down(fed, '%u')}",
        "",
    ]


def site_device_acl(fed: str, devices: Iterable[str], uploads: bool) -> list[str]:
    """A site bridge's writing rights: its own devices' topics only (never another site's or the core's
    devices): their presence, and their uploads unless the site folds them. It reads every `down/+` (the
    bridge subscribes to that pattern; the site broker's ACL decides which device reads which)."""
    return [
        *(
            line
            for device in sorted(set(devices))
            for line in (
                *([f"topic write {topics.up(fed, device)}"] if uploads else []),
                f"topic write {topics.presence(fed, device)}",
            )
        ),
        f"topic read {topics.down(fed, '+')}",
    ]


def core_bridge_acl(fed: str, site: str, devices: Iterable[str] = ()) -> list[str]:
    """What a pre-aggregated site's bridge user may do on the core broker (beyond a device's reading rights):
    carry its pre-aggregator's messages up and the coordinator's down (broker_server/scaleout/site.py), and its own
    devices' presence."""
    me = site_shard(site)
    return [
        *site_device_acl(fed, devices, uploads=False),
        f"topic write {topics.shards(fed, 'progress', me)}",
        f"topic write {topics.shards(fed, 'partial', me)}",
        f"topic write {topics.shards(fed, 'hello', me)}",
        f"topic write {topics.shards(fed, 'relay', '+')}",
        f"topic read {topics.shards(fed, 'phase')}",
        f"topic read {topics.shards(fed, 'close')}",
    ]


def acl_text(
    fed: str,
    shards: int = 0,
    sites: Iterable[str] = (),
    pre_aggregated: Iterable[str] = (),
    site_devices: Mapping[str, Iterable[str]] | None = None,
) -> str:
    """Mosquitto ACL for federation `fed`: the devices, the server, the monitor, its `shards` aggregator shards,
    and the bridge of each site broker in `sites` (of a site in `pre_aggregated`: its pre-aggregator's topics
    instead of the uploads). A bridge writes only the topics of its own site's devices (`site_devices`;
    none for a site without a list), so one compromised site cannot upload as another site's member."""
    root = f"{topics.ROOT}/{fed}"
    folded_at_site = set(pre_aggregated)
    own = site_devices or {}
    bridges = [
        line
        for site in sorted(sites)
        for line in (
            f"user {bridge_user(fed, site)}",
            *(
                core_bridge_acl(fed, site, own.get(site, ()))
                if site in folded_at_site
                else site_device_acl(fed, own.get(site, ()), uploads=True)
            ),
            f"topic write {topics.site_dropped(fed, site)}",  # the site broker's drops, for the server to see
            "",
        )
    ]
    return "\n".join(
        [
            *device_acl_lines(fed),
            "# the aggregator: the only user that reads uploads and writes the control topics (a device's down/ too);",
            "# it reads the broker's dropped-messages counter to ask devices to re-send what the broker dropped",
            f"user {server_user(fed)}",
            f"topic readwrite {root}/#",
            f"topic read {DROPPED_TOPIC}",
            "",
            "# the monitor (protofl-server status): reads the server's status and summary, writes nothing; its",
            "# deny lines are checked before the patterns above, which would give it a device's topics",
            f"user {monitor_user(fed)}",
            f"topic deny {topics.up(fed, '#')}",
            f"topic deny {topics.presence(fed, '#')}",
            f"topic deny {topics.config(fed)}",
            f"topic deny {topics.public(fed)}",
            f"topic deny {topics.round_(fed)}",
            f"topic deny {topics.down(fed, '#')}",
            f"topic read {topics.server_status(fed)}",
            f"topic read {topics.server_summary(fed)}",
            "",
            *(
                [
                    "# site brokers' bridges (broker-config --bridge): they carry their own devices' "
                    "uploads and presence up, no other device's",
                    "# (each site broker lets a device write only its own topics) and read what devices read",
                    "",
                ]
                if bridges
                else []
            ),
            *bridges,
            *shard_acl(fed, shards),
        ]
    )


def hash_matches(password: str, hashed: str) -> bool:
    """Whether `hashed` (a `$7$` line's hash) is `password`'s."""
    try:
        _, seven, iterations, salt, _digest = hashed.split("$")
        if seven != "7":
            return False
        return hmac.compare_digest(mosquitto_hash(password, base64.b64decode(salt), int(iterations)), hashed)
    except ValueError:
        return False


def read_hashes(path: Path) -> dict[str, str]:
    """user -> hash of an existing password file (empty if there is none)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    return dict(line.split(":", 1) for line in lines if ":" in line)


def password_text(
    fed_secrets: FederationSecrets, known: dict[str, str] | None = None, fresh: Iterable[str] = ()
) -> str:
    """The password file; users in `known` (an existing file's hashes) keep theirs when that file verifiably
    holds these secrets (the server's and the monitor's hashes match), so only new users (and `fresh` ones,
    just given a password) are hashed."""
    users = [
        fed_secrets.server,
        fed_secrets.monitor,
        *(fed_secrets.bridge(s) for s in sorted(fed_secrets.bridges)),
        *(fed_secrets.device(i) for i in sorted(fed_secrets.devices)),
        *(Credentials(u, p) for u, p in sorted(fed_secrets.shard_passwords.items())),
    ]
    known = dict(known or {})
    if not all(hash_matches(c.password, known.get(c.username, "")) for c in users[:2]):
        known = {}
    for user in fresh:
        known.pop(user, None)
    return "".join(f"{c.username}:{known.get(c.username) or mosquitto_hash(c.password)}\n" for c in users)


def password_lines(users: Iterable[Credentials]) -> str:
    """Mosquitto's password file for these users, each hashed afresh (a site broker's:
    broker_server/scaleout/bridge.py)."""
    return "".join(f"{c.username}:{mosquitto_hash(c.password)}\n" for c in users)


def private_dir(path: Path) -> Path:
    """Make `path` (and its missing parents) a directory only its owner can enter (0700; an existing one is
    narrowed): a state dir's files name devices, their accuracies and upload times (SECURITY.md)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o077:
        path.chmod(0o700)
    return path


def private_file(path: Path) -> int:
    """Open `path` for appending, created 0600 (an existing one is narrowed): a file descriptor."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.fchmod(fd, 0o600)
    return fd


def write_secret(path: Path, text: str) -> None:
    """Write a file readable by its owner only, atomically (never a half-written password file)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_secret_dir(path: Path, files: dict[str, str]) -> None:
    """Fill the empty (or missing) directory `path` with `files` (name -> text), each readable by its owner only,
    in one pass: written into a new sibling directory, which then replaces `path` (a crash leaves `path` as it was,
    never half of the files). A fleet's device files one by one (a temporary file and a rename each) were 24 % of a
    4,000-device start (issue 48)."""
    tmp = path.with_name(path.name + ".new")
    shutil.rmtree(tmp, ignore_errors=True)  # a crashed earlier pass's
    tmp.mkdir(mode=0o700)
    dfd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name, text in files.items():
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dfd)
            try:
                data = memoryview(text.encode())
                while data:
                    data = data[os.write(fd, data) :]
            finally:
                os.close(fd)
    finally:
        os.close(dfd)
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o755
    os.chmod(tmp, mode)
    os.replace(tmp, path)  # over an empty directory: rename(2) replaces it


@dataclass(frozen=True)
class BrokerAuth:
    """Where the generated files are, and the Mosquitto config lines that use them."""

    directory: Path
    secrets: FederationSecrets
    new_devices: tuple[str, ...] = ()

    @property
    def password_file(self) -> Path:
        return self.directory / "passwd"

    @property
    def acl_file(self) -> Path:
        return self.directory / "acl"

    def shard_file(self, index: int) -> Path:
        return self.directory / "shards" / f"shard-{index}.json"

    def device_file(self, client_id: str) -> Path:
        return self.directory / "devices" / f"{client_id}.json"

    @property
    def monitor_file(self) -> Path:
        return self.directory / "monitor.json"

    def mosquitto_lines(self) -> list[str]:
        return [
            "allow_anonymous false",
            f"password_file {self.password_file}",
            f"acl_file {self.acl_file}",
            # A device could otherwise connect with another device's client id and take its session over.
            "use_username_as_clientid true",
        ]

    def provision(self, ca_pem: str | None = None, broker: str | None = None) -> BrokerAuth:
        """Write the plain secrets: credentials.json, monitor.json and one devices/<id>.json per device (each
        carrying the federation CA's certificate `ca_pem` when the broker serves TLS with it; monitor.json also
        the `broker` URL a watcher connects to, so `protofl-server status --credentials monitor.json` needs no
        --broker). A device file that exists is rewritten only when the CA changed (monitor.json, written with
        the same CA, tells)."""
        write_secret(self.directory / "credentials.json", self.secrets.to_json() + "\n")
        monitor = device_file_text(self.secrets.monitor, self.secrets.fed, ca_pem)
        try:
            before = self.monitor_file.read_text()
        except OSError:
            before = ""
        try:  # the same but for the broker's address (a --port 0 broker moves at each start)
            was = json.loads(before)
            was.pop("broker", None)
            same_ca = was == json.loads(monitor)
        except (ValueError, AttributeError):
            same_ca = False
        if broker is not None:
            monitor = device_file_text(self.secrets.monitor, self.secrets.fed, ca_pem, broker)
        if before != monitor:
            write_secret(self.monitor_file, monitor)
        devices_dir = self.directory / "devices"
        devices_dir.mkdir(exist_ok=True)
        there = {name[: -len(".json")] for name in os.listdir(devices_dir) if name.endswith(".json")}
        present = there if same_ca else set()
        fed, new = self.secrets.fed, set(self.new_devices)
        texts = {
            f"{cid}.json": device_file_text(self.secrets.device(cid), fed, ca_pem)
            for cid in self.secrets.devices
            if cid not in present or cid in new
        }
        if not there:  # a new fleet: every file in one pass, the directory renamed into place once
            write_secret_dir(devices_dir, texts)
        else:
            for name, text in texts.items():
                write_secret(devices_dir / name, text)
        if self.secrets.shard_passwords:
            (self.directory / "shards").mkdir(exist_ok=True)
        for index in range(len(self.secrets.shard_passwords)):  # a few: written every time
            write_secret(self.shard_file(index), device_file_text(self.secrets.shard(index), self.secrets.fed, ca_pem))
        return self


def load_or_create(
    directory: Path, fed: str, device_ids: Iterable[str] = (), ca_pem: str | None = None, shards: int = 0
) -> BrokerAuth:
    """Read (or generate) `directory/credentials.json`, add missing device ids (and aggregator shards), write
    passwd, acl and the provisioning files. Existing passwords are kept, so provisioned devices keep working."""
    return prepare(directory, fed, device_ids, shards).provision(ca_pem)


def prepare(
    directory: Path,
    fed: str,
    device_ids: Iterable[str] = (),
    shards: int = 0,
    sites: Iterable[str] = (),
    pre_aggregate: bool = False,
) -> BrokerAuth:
    """Read (or generate) the federation's secrets, add missing device ids, aggregator shards and site bridges
    (`pre_aggregate`: those sites fold their uploads on a pre-aggregator; else they forward them), and write
    only what the broker reads (passwd, acl); `provision` writes the plain secrets."""
    device_ids = list(device_ids)
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    store = directory / "credentials.json"
    if store.exists():
        fed_secrets = FederationSecrets.from_json(store.read_text(), str(store))
        if fed_secrets.fed != fed:
            raise ConfigError(
                f"{store} holds credentials of federation '{fed_secrets.fed}', not '{fed}'; use "
                f"another --state-dir per federation"
            )
        added = fed_secrets.add_devices(device_ids)
    else:
        fed_secrets = FederationSecrets.create(fed)
        added = fed_secrets.add_devices(device_ids)
    fed_secrets.add_shards(shards)
    for site in sites:
        fed_secrets.add_bridge(site)
        # The devices given with a site are its own: its bridge may write their topics only.
        fed_secrets.site_devices[site] = sorted(set(device_ids))
        if pre_aggregate:
            fed_secrets.pre_aggregators.setdefault(site, new_password())
        else:
            fed_secrets.pre_aggregators.pop(site, None)
    auth = BrokerAuth(directory, fed_secrets, tuple(added))
    known = read_hashes(auth.password_file)
    text = password_text(fed_secrets, known, fresh=added)
    if text != "".join(f"{user}:{hashed}\n" for user, hashed in known.items()):
        write_secret(auth.password_file, text)
    auth.acl_file.write_text(
        acl_text(
            fed,
            len(fed_secrets.shard_passwords),
            fed_secrets.bridges,
            fed_secrets.pre_aggregators,
            fed_secrets.site_devices,
        )
    )
    return auth


def bridged_devices(directory: Path) -> set[str]:
    """The devices that connect through bridged site brokers (broker-config --bridge), per the federation's
    credentials in `directory` (none if it has none yet): they count in the fleet the core's queue must hold,
    not in the connections its broker serves."""
    store = directory / "credentials.json"
    if not store.exists():
        return set()
    found = FederationSecrets.from_json(store.read_text(), str(store))
    return {i for ids in found.site_devices.values() for i in ids}


def read_allow_list(path: Path) -> list[str]:
    """Device ids, one a line; blank lines and `#` comments are skipped."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"--allow {path}: {exc.strerror or exc}") from None
    ids = [line.split("#", 1)[0].strip() for line in lines]
    out = [check_name(i, f"--allow {path}: device id") for i in ids if i]
    if not out:
        raise ConfigError(f"--allow {path}: no device ids in the file (one id a line)")
    return out
