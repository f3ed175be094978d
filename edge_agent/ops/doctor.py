"""`protofl-edge doctor`: what stands between this device and its fleet, one line a check, each with what to do.

Checks, in the order a join needs them: the credentials file; the clock (against the validity of the fleet's CA
certificate in that file and of the broker's certificate: a Raspberry Pi without RTC boots at its last shutdown's
time, or 1970, until NTP sets it, and TLS then refuses every certificate); the broker's host name (DNS); its port;
TLS with the CA; the broker's login with the credentials; then, from what the broker retains, the clock against the
server's time in its status and the run's model against this device's free memory (the measured peaks of
edge_agent/ops/footprint.json); the data, read by join's own function against the served run's classes (or
--classes); torch and onnxruntime and their versions; free memory and disk. What it echoes is made printable.
No torch import unless torch is the check.
"""

from __future__ import annotations

import shutil
import socket
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import typer

from protofl.errors import ConfigError, ProtoFLError
from protofl.names import printable

MIN_FREE_MB = 256  # below this much free memory or disk a round's training or checkpoint may fail
CLOCK_SKEW_S = 60.0  # a device clock this far behind the server's status is wrong (rounds' deadlines are minutes)
AGAIN = "run doctor again while a run is served"
RETAINED_WAIT_S = 3.0  # how long doctor waits for the broker's retained server status and config


@dataclass(frozen=True)
class Finding:
    status: str  # ok | warn | fail
    check: str
    detail: str
    fix: str = ""

    def line(self) -> str:
        """One line whatever the detail holds: a control character a file or a peer put there (a user name
        holding a newline) shows as '?', never as a forged second line."""
        detail, fix = printable(self.detail, 2000), printable(self.fix, 2000)
        return f"{self.status.upper():<4} {self.check:<12} {detail}" + (f" -> {fix}" if fix else "")


def _utc(ts: datetime) -> str:
    return ts.strftime("%Y-%m-%d %H:%M UTC")


def clock_findings(ca_pem: str | None, peer_der: bytes | None, now: datetime) -> list[Finding]:
    """This device's clock against the CA's and the broker's certificate validity."""
    from cryptography import x509

    certs = []
    if ca_pem:
        certs.append(("the fleet's CA certificate", x509.load_pem_x509_certificate(ca_pem.encode())))
    if peer_der:
        certs.append(("the broker's certificate", x509.load_der_x509_certificate(peer_der)))
    if not certs:
        return [Finding("ok", "clock", f"{_utc(now)} (no certificate to check it against: the broker has no TLS)")]
    for what, cert in certs:
        start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
        if now < start:
            return [
                Finding(
                    "fail",
                    "clock",
                    f"this device's clock says {_utc(now)}, before {what} is valid (from {_utc(start)}): "
                    "TLS refuses it",
                    "set the clock: timedatectl set-ntp true (NTP needs the network first), or date -s 'YYYY-MM-DD "
                    "HH:MM'; a device without RTC: enable fake-hwclock or an RTC module",
                )
            ]
        if now > end:
            return [
                Finding(
                    "fail",
                    "clock",
                    f"this device's clock says {_utc(now)}, after {what} expired ({_utc(end)})",
                    "if the clock is right, the fleet's certificate expired: restart the fleet (it renews it) and "
                    "copy the new devices/<id>.json; else set the clock (timedatectl set-ntp true)",
                )
            ]
    return [Finding("ok", "clock", f"{_utc(now)}, within the certificates' validity")]


def network_findings(
    url: str,
    username: str,
    password: str,
    ca_pem: str | None,
    tls_ca: str | None,
    fed: str = "default",
    retained: dict[str, bytes] | None = None,
) -> list[Finding]:
    """DNS, the port, TLS with the CA and the broker's login; stops at the first that fails. Logged in, what the
    broker retains for federation `fed` (its server status and config) goes into `retained`, by topic."""
    import tempfile

    from protofl.transport.broker_url import parse_broker_url
    from protofl.transport.mqtt import MqttTransport, TransportError
    from protofl.transport.tls import explain, probe

    out: list[Finding] = []
    with tempfile.TemporaryDirectory(prefix="protofl-doctor-") as tmp:
        if ca_pem and not tls_ca:
            tls_ca = str(Path(tmp) / "ca.pem")
            Path(tls_ca).write_text(ca_pem)
        opts = parse_broker_url(url).with_auth(username, password, tls_ca)
        try:
            addrs = sorted({str(a[4][0]) for a in socket.getaddrinfo(opts.host, opts.port, type=socket.SOCK_STREAM)})
        except OSError as exc:
            return [
                Finding(
                    "fail",
                    "dns",
                    f"cannot resolve '{opts.host}' ({exc})",
                    "check the host name in --broker "
                    "(or the file's broker), /etc/resolv.conf, or use the server's IP address",
                )
            ]
        out.append(Finding("ok", "dns", f"{opts.host} is {', '.join(addrs)}"))
        try:
            socket.create_connection((opts.host, opts.port), timeout=5).close()
        except OSError as exc:
            return [
                *out,
                Finding(
                    "fail",
                    "port",
                    f"{opts.host}:{opts.port} unreachable ({exc})",
                    "is the fleet running there (protofl-server fleet), listening beyond loopback "
                    "(--listen 0.0.0.0:PORT), and the port open in its firewall?",
                ),
            ]
        out.append(Finding("ok", "port", f"{opts.host}:{opts.port} accepts connections"))
        if opts.tls:
            why = probe(opts)
            if why is not None:
                text = explain(why, opts) or str(why)
                return [
                    *out,
                    Finding(
                        "fail",
                        "tls",
                        text,
                        "use the devices/<id>.json of this fleet (it carries the "
                        "fleet's CA), or --tls-ca with the CA that signed the broker's certificate",
                    ),
                ]
            out.append(Finding("ok", "tls", "the broker's certificate is signed by the CA and names the host"))
        else:
            out.append(
                Finding(
                    "warn",
                    "tls",
                    "no TLS (mqtt://): passwords and uploads cross the network in clear",
                    "a fleet beyond loopback serves TLS: use mqtts://",
                )
            )
        transport = MqttTransport(opts, f"{username}-doctor")
        try:
            transport.connect(8)
            out.append(Finding("ok", "login", f"the broker takes {username}'s credentials"))
            if retained is not None:
                retained.update(_retained(transport, fed))
        except (TransportError, TimeoutError) as exc:
            out.append(
                Finding(
                    "fail",
                    "login",
                    str(exc),
                    "this device may be revoked, or the file is another "
                    "fleet's: ask for a new one (protofl-server devices add ID)",
                )
            )
        finally:
            transport.close()
    return out


def _retained(transport: object, fed: str) -> dict[str, bytes]:
    """The server's retained status and config, as the broker hands them to a new subscriber (what came within
    `RETAINED_WAIT_S`: a fleet between runs retains no config)."""
    import threading

    from protofl import topics

    got: dict[str, bytes] = {}
    both = threading.Event()
    wanted = (topics.server_status(fed), topics.config(fed))

    def keep(topic: str, payload: bytes) -> None:
        if payload:
            got[topic] = payload
        if all(t in got for t in wanted):
            both.set()

    for topic in wanted:
        transport.subscribe(topic, keep)  # type: ignore[attr-defined]
    both.wait(RETAINED_WAIT_S)
    return dict(got)


def _retained_message(payload: bytes | None, check: str, what: str, why_none: str) -> object:
    """A retained message, or the warning `check` says where there is none or it cannot be read."""
    from protofl.wire import decode_message

    if payload is None:
        return Finding("warn", check, f"no {what} retained: {why_none}", AGAIN)
    try:
        return decode_message(payload)[1]
    except ProtoFLError as exc:
        return Finding("warn", check, f"the {what} is unreadable ({exc})", "")


def server_clock_findings(status: bytes | None, now: datetime) -> list[Finding]:
    """This device's clock against the server's time in its retained status (`with_server_time`). The status is
    as old as the server's last change, so only a device clock behind it is known to be wrong."""
    from protofl.wire import Status
    from protofl.wire.messages import server_time

    msg = _retained_message(status, "server-time", "server status", "no run served yet")
    if isinstance(msg, Finding):
        return [msg]
    said = server_time(msg.detail) if isinstance(msg, Status) else None
    if said is None:
        return [Finding("warn", "server-time", "the server's status carries no time (an older server)", "")]
    behind = said - now.timestamp()
    when = _utc(datetime.fromtimestamp(said, timezone.utc))
    if behind > CLOCK_SKEW_S:
        return [
            Finding(
                "fail",
                "server-time",
                f"this device's clock ({_utc(now)}) is {behind / 60:.0f} min behind the server's: its status was "
                f"written at {when}",
                "set the clock: timedatectl set-ntp true (NTP needs the network first), or date -s 'YYYY-MM-DD HH:MM'",
            )
        ]
    return [Finding("ok", "server-time", f"not behind the server's (its status was written at {when})")]


def model_findings(config: bytes | None, available_mb: int | None) -> list[Finding]:
    """The run's model (the retained config's archs) against this device's available memory, by the peaks
    bench/bench_footprint.py measured (edge_agent/ops/footprint.json), under the run's preset where it was measured."""
    from edge_agent.ops.footprint import peak_mb
    from protofl.wire import Config

    msg = _retained_message(config, "model", "run's config", "no run is served now")
    if isinstance(msg, Finding):
        return [msg]
    archs = [str(a) for a in msg.params.get("archs", ())] if isinstance(msg, Config) else []
    preset = msg.preset if isinstance(msg, Config) else None
    peaks = {a: peak_mb(a, preset) for a in archs}
    measured = {a: round(p) for a, p in peaks.items() if p is not None}
    if not measured:
        return [
            Finding(
                "warn",
                "model",
                f"the run's model {', '.join(archs) or '?'} has no measured footprint",
                "measure it: python -m bench.bench_footprint --archs ARCH",
            )
        ]
    arch, peak = max(measured.items(), key=lambda kv: kv[1])
    what = f"the run's model {arch} peaked at {peak} MB in a measured join (edge_agent/ops/footprint.json)"
    if available_mb is None:
        return [Finding("warn", "model", f"{what}; this device's free memory is unknown", "")]
    if available_mb < peak:
        return [
            Finding(
                "fail",
                "model",
                f"{what}; {available_mb} MB available here",
                "stop other programs, join with a smaller --arch (mlp peaked at "
                f"{round(peak_mb('mlp', preset) or 0)} MB), or ask for a run with a smaller model",
            )
        ]
    return [Finding("ok", "model", f"{what}; {available_mb} MB available here")]


def available_mb() -> int | None:
    """MemAvailable from /proc/meminfo, in MB (None where there is none)."""
    try:
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        return int(meminfo["MemAvailable"].split()[0]) // 1024
    except (OSError, KeyError, ValueError):
        return None


def fleet_classes(config: bytes | None) -> tuple[int, tuple[int, ...], list[str] | None] | None:
    """The served run's classes as join holds its data to them: (num_classes, in_shape, class_names) of the
    retained config (None where there is none or it does not read)."""
    from protofl.config import FederationConfig
    from protofl.wire import Config, decode_message

    if config is None:
        return None
    try:
        msg = decode_message(config)[1]
        if not isinstance(msg, Config):
            return None
        cfg = FederationConfig.from_dict(dict(msg.params))
    except (ProtoFLError, ValueError, TypeError, KeyError):
        return None
    names = list(cfg.class_names) if cfg.class_names is not None else None
    return cfg.num_classes, tuple(cfg.in_shape), names


def data_findings(
    data: str | None, classes: Path | None, config: bytes | None = None, data_dir: str | None = None
) -> list[Finding]:
    """`--data` read and checked by join's own function (`read_own`: every file decoded, labels and class folders
    matched with the class names) against the served run's classes where the broker retains its config, else the
    class names of `--classes` (read as `protofl-server start --classes` reads them)."""
    from edge_agent.ops.local_data import read_own
    from protofl.data.own import read_classes_file

    out: list[Finding] = []
    names: list[str] | None = None
    if classes is not None:
        try:
            names = read_classes_file(classes, "--classes file")
        except ProtoFLError as exc:
            return [Finding("fail", "classes", str(exc), "pass the fleet's class list: one class name a line")]
    fleet = fleet_classes(config)
    num_classes: int | None = len(names) if names is not None else None
    in_shape: tuple[int, ...] | None = None
    if fleet is not None:
        num_classes, in_shape = fleet[0], fleet[1]
        if fleet[2] is not None:
            if names is not None and names != fleet[2]:
                out.append(
                    Finding(
                        "warn",
                        "classes",
                        f"--classes names {len(names)} classes, the served run {len(fleet[2])}: "
                        "the data is checked against the run's",
                        "pass the class list the fleet was started with",
                    )
                )
            names = fleet[2]
    if data is None:
        return [*out, Finding("warn", "data", "not checked", "pass --data as to join")]
    try:
        train, test = read_own(data, data_dir, 0, num_classes, in_shape, names)
    except ProtoFLError as exc:
        return [*out, Finding("fail", "data", str(exc), "fix --data as join names it: join refuses this data")]
    except (OSError, ValueError, MemoryError) as exc:
        return [*out, Finding("fail", "data", f"--data {data}: unreadable ({exc})", "fix --data: join refuses it")]
    size = len(train) + (len(test) if test is not None else 0)
    out.append(Finding("ok", "data", f"{data}: {size} samples of {train.num_classes} classes, read as join reads it"))
    if names is not None:
        where = "the served run's" if fleet is not None and fleet[2] is not None else "--classes'"
        out.append(Finding("ok", "classes", f"every label names one of {where} {len(names)} classes"))
    else:
        out.append(
            Finding(
                "warn",
                "classes",
                "the data's class names are not checked (no class list)",
                "pass --classes with the fleet's class list, or run doctor while a run is served",
            )
        )
    return out


def software_findings() -> list[Finding]:
    """torch and onnxruntime: a device needs one of them. With torch it trains (every preset); with onnxruntime alone
    it joins as a lite device (protofl/lite.py: the presets with the ridge predictor); with neither it cannot join."""
    out = []
    try:
        import torch

        torch_version: str | None = torch.__version__
    except ImportError:
        torch_version = None
    try:
        import onnxruntime

        ort_version: str | None = onnxruntime.__version__
    except ImportError:
        ort_version = None
    if torch_version is not None:
        out.append(Finding("ok", "torch", f"torch {torch_version}"))
    elif ort_version is not None:
        out.append(
            Finding(
                "warn",
                "torch",
                "not installed: join runs as a lite device (onnxruntime; the presets with the ridge predictor, "
                "the default protofl; others refuse it)",
                "pip install 'protofl-edge[device]' for a device that trains",
            )
        )
    else:
        from protofl.requirements import TORCH_INSTALL_HINT

        out.append(
            Finding(
                "fail",
                "torch",
                "neither torch nor onnxruntime can be imported: join needs one of them",
                f"{TORCH_INSTALL_HINT} (a device that trains), or pip install 'protofl-edge[lite]' (a lite device)",
            )
        )
    if ort_version is not None:
        out.append(Finding("ok", "onnxruntime", f"onnxruntime {ort_version}"))
    elif torch_version is not None:
        out.append(
            Finding(
                "warn",
                "onnxruntime",
                "not installed (only predict and --extractor onnx need it)",
                "pip install 'protofl-edge[onnx]'",
            )
        )
    return out


def resource_findings(where: Path) -> list[Finding]:
    out = []
    free_mb = available_mb()
    if free_mb is None:
        out.append(Finding("warn", "memory", "unknown (no /proc/meminfo)"))
    else:
        status = "ok" if free_mb >= MIN_FREE_MB else "warn"
        out.append(
            Finding(
                status,
                "memory",
                f"{free_mb} MB available",
                "" if status == "ok" else "stop other programs, or join with a smaller --arch / --profile",
            )
        )
    disk_mb = shutil.disk_usage(where).free // 2**20
    status = "ok" if disk_mb >= MIN_FREE_MB else "warn"
    out.append(
        Finding(
            status,
            "disk",
            f"{disk_mb} MB free in {where}",
            "" if status == "ok" else "free space: checkpoints and artifacts go there",
        )
    )
    return out


def doctor_command(
    credentials: Path | None = typer.Option(None, help="This device's credentials file (devices/<id>.json)."),
    broker: str | None = typer.Option(None, help="Broker URL (default: the one in --credentials)."),
    data: str | None = typer.Option(None, help="The --data this device joins with."),
    data_dir: str | None = typer.Option(None, "--data-dir", help="Where fashion-mnist's files are (as join's)."),
    classes: Path | None = typer.Option(None, "--classes", help="The fleet's class names, one a line."),
    tls_ca: str | None = typer.Option(None, "--tls-ca", help="CA certificate (default: the one in --credentials)."),
    state_dir: Path = typer.Option(Path("."), "--state-dir", help="Where checkpoints and artifacts go (disk)."),
) -> None:
    """Check what a join needs, one line each with what to do; exit 1 when a check fails."""
    from protofl import topics
    from protofl.transport.credentials import read_device_file

    found: list[Finding] = []
    ca_pem = username = password = None
    fed = "default"
    if credentials is not None:
        try:
            file = read_device_file(credentials)
            ca_pem, username, password = file.ca_pem, file.credentials.username, file.credentials.password
            fed = file.fed or fed
            broker = broker or file.broker
            found.append(Finding("ok", "credentials", f"{credentials}: device {username}, fleet '{file.fed}'"))
        except ConfigError as exc:
            found.append(
                Finding("fail", "credentials", str(exc), "copy this device's devices/<id>.json from the fleet")
            )
    else:
        found.append(Finding("warn", "credentials", "not checked", "pass --credentials devices/<id>.json"))
    peer = None
    if broker is not None:
        from protofl.transport.broker_url import parse_broker_url
        from protofl.transport.tls import peer_certificate

        try:
            opts = parse_broker_url(broker)
            peer = peer_certificate(opts.host, opts.port) if opts.tls else None
        except ProtoFLError as exc:
            found.append(Finding("fail", "broker", str(exc), "fix --broker: mqtts://HOST:PORT"))
            broker = None
    found += clock_findings(ca_pem, peer, datetime.now(timezone.utc))
    retained: dict[str, bytes] = {}
    if broker is not None and username is not None and password is not None:
        found += network_findings(broker, username, password, ca_pem, tls_ca, fed, retained)
        if any(f.check == "login" and f.status == "ok" for f in found):
            found += server_clock_findings(retained.get(topics.server_status(fed)), datetime.now(timezone.utc))
            found += model_findings(retained.get(topics.config(fed)), available_mb())
    elif broker is None:
        found.append(Finding("warn", "broker", "not checked", "pass --broker, or credentials that name it"))
    found += data_findings(data, classes, retained.get(topics.config(fed)), data_dir)
    found += software_findings()
    found += resource_findings(state_dir if state_dir.exists() else Path("."))
    for f in found:
        typer.echo(f.line())
    if any(f.status == "fail" for f in found):
        raise typer.Exit(1)
