"""The aggregator's own rate: uploads/s decoded, screened, folded and journaled, in-process and through
the secured broker, beside the broker's own rate (issue 27, "a faster aggregator").

    python -m bench.bench_aggregator                                   # in-process, this tree
    python -m bench.bench_aggregator --baseline /path/to/main/worktree # and that tree's, interleaved
    python -m bench.bench_aggregator --broker --out bench/results/AGGREGATOR.md

1. In-process (one core, no network): the real `Aggregator` (broker_server/core/shell.py) behind the in-process
   transport, with a journal (DurableState: the default group commit, fsync off so the disk is not what is
   measured), fed N real encoded uploads of N joined devices; rate = N / (time from the first upload to the
   phase's close). Uploads are what the devices of each preset send in round 1, built by the device's own code
   (`EdgeAgent.round_uploads` on the config message the server publishes; a device's messages count as one
   upload): tinyproto (CPS-compressed scaled prototypes, s = m/10 values per class, no counts), protofl (the
   default preset: its ridge statistics, 137k float32 values sent once, then spherical CPS unit prototypes on
   the masks; about 0.55 MB a device, so N = 4000 holds 2.2 GB of uploads), fedproto (full 512-d mean
   prototypes with counts), and APUD (the top-K adapter coordinates of the `refprotofl` adapter, d = 71,242,
   K = d/10, sent as a packed mask). The bench imports torch for its devices. `--baseline DIR` runs the same
   workers with DIR's `protofl` and `broker_server` (a `git worktree add` of the previous revision),
   alternating trees per repeat, so both are measured under the same load.
2. Through the broker (`--broker`): the real `protofl-server start` path (a spawned secured Mosquitto
   with generated credentials, TLS off on loopback as the default, the journal with group commit and fsync)
   and a publisher process playing the N devices with their own credentials; rate = N / (round close -
   round open) from the server's round record. Beside it, in the same run, the broker's own rate: the same
   publisher into `mosquitto_sub` (a C subscriber: the rate the broker can deliver, not what Python can
   read). `mosquitto_sub` comes from Debian's `mosquitto-clients` (`apt-get install -y mosquitto-clients`),
   a bench-only dependency; without it part 2 says so and is skipped. `--broker-shards 0,4,8`: part 2 for one
   aggregator process and for `start --shards 4` and `--shards 8` (the round's rate is then the shards' and
   their coordinator's together; "per server CPU s" is left out, the folding being in the shards).

Figures vary with the machine's load (printed with them); compare the two trees only within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
FED = "bench"
WORKLOADS = ("tinyproto", "protofl", "fedproto", "apud")
SAMPLES = 20  # each bench device's training samples (two of each of the 10 classes)


# -- part 1: in-process ---------------------------------------------------------------------------


def _path(tree: Path) -> str:
    """`tree` first on a child's import path, before what ours has (carried wheels on a bare machine)."""
    return os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p)


def workload_preset(name: str) -> tuple[str, dict[str, Any]]:
    """The preset and config values of workload `name` (besides the federation's size)."""
    common: dict[str, Any] = dict(num_classes=10, proto_dim=512, seed=0)
    if name == "apud":  # RefProtoFL's adapter uploads alone (no public set in this benchmark)
        return "refprotofl", dict(erpa=False, prototypes="none", **common)
    return name, common


def workload_config(name: str, n: int) -> Any:
    from protofl.presets import make_config

    preset, values = workload_preset(name)
    return make_config(preset, rounds=1, min_clients=n, round_timeout=600.0, **values)


def device_ids(n: int) -> list[str]:
    return [f"device-{i + 1}" for i in range(n)]  # as `protofl-server start --devices N` names them


def server_config(cfg: Any, fed: str = FED) -> bytes:
    """The config message a server of `cfg` publishes (retained), as its devices receive it: an in-process
    `Aggregator` announces the federation (its support masks, adapter layout and limits)."""
    from broker_server.core.shell import Aggregator
    from protofl import topics
    from protofl.transport import InProcessBroker

    broker = InProcessBroker()
    Aggregator(cfg, fed, broker.connect("server")).start(subscribe=False)
    return broker.retained[topics.config(fed)]


def device_uploads(config: bytes, seed: int, samples: int = SAMPLES) -> list[Any]:
    """One device's round-1 training uploads, built by the device's own code: an `EdgeAgent` adopts the
    server's config message and builds the round's uploads as a round builds them (`round_uploads`, no
    training: values differ from a trained model's, bytes and checks do not), e.g. the `protofl` preset's ridge
    statistics (sent once, in round 1) beside its CPS prototypes. `samples` random inputs, every class among
    them (few: the device embeds them, and their number changes no byte)."""
    from edge_agent.core.agent import ClientData, EdgeAgent
    from protofl.plan import Phase
    from protofl.wire import Config, decode_message

    _, msg = decode_message(config)
    assert isinstance(msg, Config), type(msg)
    shape, classes = tuple(msg.params["in_shape"]), int(msg.params["num_classes"])
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((samples, *shape)).astype(np.float32)
    y = rng.permutation(np.arange(samples, dtype=np.int64) % classes)
    agent = EdgeAgent(f"bench-{seed}", "bench", ClientData(x, y, x[:classes], y[:classes]))
    agent.on_config(msg)
    assert agent.plan is not None, "the device refused the server's config"
    return [m for phase, m in agent.round_uploads(1) if phase is Phase.TRAIN]


def device_bodies(cfg: Any, distinct: int, seed: int = 0, fed: str = FED) -> list[list[Any]]:
    """`distinct` devices' round-1 training uploads (their messages), built by the device's own code."""
    config = server_config(cfg, fed)
    return [device_uploads(config, seed + i) for i in range(distinct)]


def make_uploads(
    cfg: Any, n: int, distinct: int, seed: int = 0, fed: str = FED, bodies: list[list[Any]] | None = None
) -> tuple[list[bytes], list[list[bytes]]]:
    """n joins and each device's uploads (round 1, the phase that takes them: one or more messages each, in the
    order a device sends them), device i sending the bodies of `bodies[i % len(bodies)]` (default: `distinct`
    devices' `device_bodies`)."""
    from protofl.wire import Join, encode_message

    ids = device_ids(n)
    joins = [
        encode_message(Join(arch="", n_samples=SAMPLES, profile="", agent_version="bench"), fed=fed, sender=c)
        for c in ids
    ]
    bodies = device_bodies(cfg, distinct, seed, fed) if bodies is None else bodies
    uploads = [
        [encode_message(m, fed=fed, sender=c, round=1, phase="train") for m in bodies[i % len(bodies)]]
        for i, c in enumerate(ids)
    ]
    return joins, uploads


def write_bodies(path: Path, bodies: list[list[Any]]) -> None:
    """Devices' bodies to a file for a publisher child, which then needs neither torch nor the time to build them
    (a reader waiting for its messages would give up first on a loaded machine): per device its message count,
    then each message's length and wire encoding (the project's own format, no pickle)."""
    from protofl.wire import encode_message

    with path.open("wb") as fh:
        for mine in bodies:
            fh.write(len(mine).to_bytes(4, "big"))
            for m in mine:
                raw = encode_message(m, fed=FED, sender="bench", round=1, phase="train")
                fh.write(len(raw).to_bytes(8, "big") + raw)


def read_bodies(path: Path) -> list[list[Any]]:
    from protofl.wire import decode_message

    data, at, out = path.read_bytes(), 0, []
    while at < len(data):
        count, at = int.from_bytes(data[at : at + 4], "big"), at + 4
        mine = []
        for _ in range(count):
            size, at = int.from_bytes(data[at : at + 8], "big"), at + 8
            mine.append(decode_message(data[at : at + size])[1])
            at += size
        out.append(mine)
    return out


class Setup:
    """A joined in-process aggregator (round 1 open) with its journal, and the uploads to feed it: `uploads` and
    `topics`, one entry per message, each device's messages in the order it sends them."""

    def __init__(self, name: str, n: int, distinct: int = 64) -> None:
        from broker_server.core.durable import DurableState
        from broker_server.core.shell import Aggregator
        from protofl import topics
        from protofl.transport import InProcessBroker

        cfg = workload_config(name, n)
        joins, per_device = make_uploads(cfg, n, distinct)
        ids = device_ids(n)
        self.uploads = [p for ups in per_device for p in ups]
        self.device_bytes = sum(len(p) for p in per_device[0])  # what one device uploads in the round
        self.name, self.n = name, n
        self.work = Path(tempfile.mkdtemp(prefix="bench-agg-"))
        journal = os.environ.get("BENCH_JOURNAL", "group")  # group (fsync off) | fsync | off
        self.durable = (
            None
            if journal == "off"
            else DurableState(self.work / "state", FED, fsync=journal == "fsync", group_commit=True)
        )
        self.agg = Aggregator(cfg, FED, InProcessBroker().connect("server"), expected_clients=ids)
        if self.durable is not None:
            self.durable.bind(self.agg)
        self.agg.start()
        for i, p in enumerate(joins):
            self.agg.on_message(topics.up(FED, ids[i]), p)
        assert self.agg.round == 1 and not self.agg.dropped, self.agg.dropped
        self.topics = [topics.up(FED, c) for c, ups in zip(ids, per_device, strict=True) for _ in ups]

    def drive(self) -> tuple[float, float]:
        """Feed every upload: (wall seconds, CPU seconds of this process) from the first to the phase's close."""
        agg, durable = self.agg, self.durable
        t0, c0 = time.perf_counter(), time.process_time()
        for i, p in enumerate(self.uploads):
            agg.on_message(self.topics[i], p)
            if i % 64 == 63 and durable is not None:
                durable.sync()  # group commit: one sync per pumped batch, as the service does
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        assert not agg.dropped and len(agg.records) == 1 and len(agg.records[0].clients) == self.n, agg.dropped
        return elapsed, cpu

    def close(self) -> None:
        if self.durable is not None:
            self.durable.close()
        shutil.rmtree(self.work, ignore_errors=True)


def inprocess_rate(name: str, n: int, distinct: int = 64) -> dict[str, Any]:
    """One in-process round of n devices' uploads of workload `name` (a device's round uploads count as one, however
    many messages they take): uploads/s from the first upload to the close."""
    setup = Setup(name, n, distinct)
    try:
        elapsed, cpu = setup.drive()
    finally:
        setup.close()
    # Per CPU second is the one-core rate whatever else the machine runs; per wall second is what it gave here.
    return {
        "workload": name,
        "uploads": n,
        "upload_bytes": setup.device_bytes,
        "uploads_per_s": n / cpu,
        "uploads_per_wall_s": n / elapsed,
        "reader": "fast" if setup.agg._fast else "reference",
    }


def _worker(args: argparse.Namespace) -> None:
    """Child process: one in-process measurement with whatever `protofl` its PYTHONPATH gives."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Logging as `start` sets it up: the root at INFO to stderr, the aggregator's own logger at WARNING (INFO: -v).
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    info = os.environ.get("BENCH_LOG") == "info"
    logging.getLogger("protofl.server").setLevel(logging.INFO if info else logging.WARNING)
    if os.environ.get("BENCH_READER") == "reference":  # this tree with msgspec's upload reader turned off
        from broker_server.core import shell

        shell.fast_reader.usable = lambda limits: False
    print(json.dumps(inprocess_rate(args.worker, args.n)), flush=True)


REFERENCE_READER = "this, reference reader"  # the label of `--readers`' extra column
# `--journals`' extra columns: this tree without the journal, and with its group commit's fsync on
JOURNALS = {"this, no journal": "off", "this, journal with fsync": "fsync"}


def run_worker(
    tree: Path, workload: str, n: int, reader: str = "", log_level: str = "warning", journal: str = "group"
) -> dict[str, Any]:
    env = dict(
        os.environ,
        PYTHONPATH=_path(tree),
        OMP_NUM_THREADS="1",
        OPENBLAS_NUM_THREADS="1",
        BENCH_READER=reader,
        BENCH_LOG=log_level,
        BENCH_JOURNAL=journal,
    )
    # Run this file by path: the tree under test may not have it.
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--worker", workload, "--n", str(n)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    if out.returncode:
        raise RuntimeError(f"worker {workload} on {tree} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def inprocess(
    trees: dict[str, Path], workloads: list[str], n: int, repeats: int, log_level: str = "warning"
) -> dict[str, Any]:
    rates: dict[str, dict[str, list[float]]] = {w: {t: [] for t in trees} for w in workloads}
    walls: dict[str, dict[str, list[float]]] = {w: {t: [] for t in trees} for w in workloads}
    sizes: dict[str, int] = {}
    readers: dict[str, str] = {}
    for r in range(repeats):
        for w in workloads:
            for label, tree in trees.items():
                reader = "reference" if label == REFERENCE_READER else ""
                res = run_worker(tree, w, n, reader, log_level, JOURNALS.get(label, "group"))
                rates[w][label].append(res["uploads_per_s"])
                readers[label] = res.get("reader", "not recorded")  # an older tree does not say
                walls[w][label].append(res["uploads_per_wall_s"])
                sizes[w] = res["upload_bytes"]
                print(f"repeat {r + 1}/{repeats} {w:>9} {label:>8}: {res['uploads_per_s']:8.0f} uploads/s", flush=True)
    return {
        "uploads": n,
        "repeats": repeats,
        "upload_bytes": sizes,
        "readers": readers,
        "log_level": log_level,
        "setup": {
            label: server_setup(tree, workloads[0], "reference" if label == REFERENCE_READER else "fast")
            for label, tree in trees.items()
        },
        "rates": rates,
        "wall_rates": walls,
        "median": {w: {t: statistics.median(v) for t, v in d.items()} for w, d in rates.items()},
    }


# -- part 2: through the secured broker ----------------------------------------------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        n, byte = n >> 7, n & 0x7F
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _utf8(text: str) -> bytes:
    raw = text.encode()
    return len(raw).to_bytes(2, "big") + raw


def _packet(kind: int, body: bytes) -> bytes:
    return bytes([kind]) + _varint(len(body)) + body


def _read_packet(sock: Any) -> tuple[int, bytes]:
    """One MQTT packet from a blocking socket: (first byte, body)."""

    def exactly(k: int) -> bytes:
        buf = bytearray()
        while len(buf) < k:
            chunk = sock.recv(k - len(buf))
            if not chunk:
                raise ConnectionError("the broker closed the connection")
            buf += chunk
        return bytes(buf)

    first = exactly(1)[0]
    length, shift = 0, 0
    while True:
        byte = exactly(1)[0]
        length |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            break
    return first, exactly(length)


def publisher_main(port: int, creds: Path, bodies: Path, n: int, fed: str, wait_round: bool) -> None:
    """Child process: n devices, each its own MQTT 3.1.1 connection with its own credentials (a few lines of
    protocol over plain sockets, so that thousands of devices cost one process no threads): n joins, then
    (after the round message, with `wait_round`) each device's uploads at QoS 1 as fast as they go; waits for
    every ack. `bodies`: the devices' uploads (`write_bodies`), device i sending those of device i mod their count."""
    import resource
    import socket

    from protofl import topics
    from protofl.wire import read_header

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, n + 256)), hard))
    joins, uploads = make_uploads(None, n, 0, fed=fed, bodies=read_bodies(bodies))
    ids = device_ids(n)
    socks = []
    for cid in ids:
        password = json.loads((creds / f"{cid}.json").read_text())["password"]
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head = _utf8("MQTT") + bytes([4, 0x80 | 0x40 | 0x02]) + (600).to_bytes(2, "big")
        sock.sendall(_packet(0x10, head + _utf8(cid) + _utf8(cid) + _utf8(password)))
        socks.append(sock)
    for cid, sock in zip(ids, socks, strict=True):
        kind, body = _read_packet(sock)
        if kind != 0x20 or body[1] != 0:
            raise SystemExit(f"{cid}: the broker refused the connection (CONNACK {body!r})")
    watcher = socks[0]
    announced = [not wait_round]
    if wait_round:  # the federation's config and its round are retained: whoever subscribes gets them
        watcher.sendall(
            _packet(
                0x82, (1).to_bytes(2, "big") + _utf8(topics.config(fed)) + b"\x00" + _utf8(topics.round_(fed)) + b"\x00"
            )
        )

    def publish_all(payloads: list[list[bytes]]) -> None:
        """Each device's messages in turn, in its order (packet ids 1, 2, ... on its own connection)."""
        for cid, sock, mine in zip(ids, socks, payloads, strict=True):
            for j, payload in enumerate(mine):
                sock.sendall(_packet(0x32, _utf8(topics.up(fed, cid)) + (j + 1).to_bytes(2, "big") + payload))

    round_open = [False]

    def acks(payloads: list[list[bytes]]) -> None:
        for sock, mine in zip(socks, payloads, strict=True):
            left = len(mine)
            while left:
                kind, body = _read_packet(sock)
                if kind >> 4 == 4:  # PUBACK
                    left -= 1
                else:
                    note(kind, body)

    def note(kind: int, body: bytes) -> None:
        if kind >> 4 == 3:  # a PUBLISH (QoS 0) on the config or the round topic
            tlen = int.from_bytes(body[:2], "big")
            topic = body[2 : 2 + tlen].decode()
            announced[0] |= topic == topics.config(fed)
            if topic == topics.round_(fed) and read_header(body[2 + tlen :]).round >= 1:
                round_open[0] = True

    # The server announces the federation once it (and each of its shards) reads the uploads: a join published
    # before that would reach no shard's shared subscription.
    while not announced[0]:
        note(*_read_packet(watcher))
    publish_all([[j] for j in joins])
    acks([[j] for j in joins])
    while wait_round and not round_open[0]:
        note(*_read_packet(watcher))
    t0 = time.perf_counter()
    publish_all(uploads)
    acks(uploads)
    print(f"{time.perf_counter() - t0:.4f}", flush=True)
    for sock in socks:
        sock.sendall(b"\xe0\x00")
        sock.close()


def subscriber_main(port: int, fed: str, password: str, n: int, messages: int) -> None:
    """Child process: the server's MQTT transport (protofl/transport/mqtt.py, as `start` makes it: MQTT 5,
    persistent session, pumped delivery, manual acks, one no-op 'journal' hook per batch) doing no work with
    what it gets: 2n messages (joins, then uploads) read, each stamped; prints the stamps. What one Python
    process can take from the broker before the aggregator does anything. `messages`: the uploads' count."""
    from broker_server.ops.security import server_user
    from protofl.transport.broker_url import parse_broker_url
    from protofl.transport.mqtt import MqttTransport

    user = server_user(fed)
    stamps: list[float] = []
    t = MqttTransport(
        parse_broker_url(f"mqtt://127.0.0.1:{port}").with_auth(user, password),
        user,
        persistent_session=True,
        deliver="pump",
        manual_ack=True,
    )
    t.before_ack = lambda: None
    t.connect(30)
    t.subscribe(f"protofl/{fed}/up/+", lambda topic, payload: stamps.append(time.perf_counter()))
    time.sleep(1.0)  # the SUBACK (as for mosquitto_sub: nothing retained to wait for)
    print("subscribed", flush=True)
    idle_since = time.monotonic()
    while len(stamps) < n + messages and time.monotonic() - idle_since < 60:
        if t.pump(timeout=1.0):
            idle_since = time.monotonic()
    t.close()
    if len(stamps) < n + messages:
        raise SystemExit(f"the transport read {len(stamps)} of {n + messages} messages")
    print(" ".join(f"{x:.6f}" for x in stamps[-messages:]), flush=True)


def raw_subscriber_main(port: int, fed: str, password: str, n: int, messages: int) -> None:
    """Child process: a bare paho-mqtt client (MQTT 5, its network thread acknowledging at once, a callback that
    only stamps): the Python MQTT client's own ceiling, beneath the server's transport. Prints the stamps."""
    import paho.mqtt.client as paho

    from broker_server.ops.security import server_user

    user = server_user(fed)
    stamps: list[float] = []
    done = threading.Event()

    def on_message(client: Any, userdata: Any, msg: Any) -> None:
        stamps.append(time.perf_counter())
        if len(stamps) >= n + messages:
            done.set()

    c = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=user, protocol=paho.MQTTv5)
    c.username_pw_set(user, password)
    c.on_message = on_message
    c.connect("127.0.0.1", port)
    c.subscribe(f"protofl/{fed}/up/+", qos=1)
    c.loop_start()
    time.sleep(1.0)
    print("subscribed", flush=True)
    done.wait(120)
    c.loop_stop()
    c.disconnect()
    if len(stamps) < n + messages:
        raise SystemExit(f"paho read {len(stamps)} of {n + messages} messages")
    print(" ".join(f"{x:.6f}" for x in stamps[-messages:]), flush=True)


def _spawn_publisher(port: int, creds: Path, bodies: Path, n: int, fed: str, wait_round: bool) -> Any:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--publisher",
        str(port),
        "--creds",
        str(creds),
        "--bodies",
        str(bodies),
        "--n",
        str(n),
        "--fed",
        fed,
    ] + (["--wait-round"] if wait_round else [])
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=_path(REPO)))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for(path: Path, timeout: float, proc: Any) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > end:
            said = proc.stdout.read()[-3000:] if proc.poll() is not None and proc.stdout is not None else ""
            raise RuntimeError(f"{path} did not appear (server exit code {proc.poll()}); its output:\n{said}")
        time.sleep(0.1)


class CpuSampler:
    """A process's CPU seconds (user + system, its threads, not its children), sampled every 20 ms against the
    wall clock, so that the CPU it spent between two wall-clock times (a round's open and close) can be read
    afterwards: what the `start` path would fold with a core of its own, where the bench's publisher and
    broker share the machine's cores with it."""

    def __init__(self, pid: int) -> None:
        import threading

        self.path, self.samples = Path(f"/proc/{pid}/stat"), [(time.time(), 0.0)]
        self._tick = os.sysconf("SC_CLK_TCK")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            try:
                fields = self.path.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                return
            self.samples.append((time.time(), (int(fields[11]) + int(fields[12])) / self._tick))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def at(self, t: float) -> float:
        """CPU seconds at wall time `t`, interpolated between the samples around it."""
        import bisect

        times = [x[0] for x in self.samples]
        i = min(max(bisect.bisect_left(times, t), 1), len(times) - 1)
        (t0, c0), (t1, c1) = self.samples[i - 1], self.samples[i]
        return c0 + (c1 - c0) * min(max((t - t0) / (t1 - t0), 0.0), 1.0) if t1 > t0 else c1

    def between(self, start: float, end: float) -> float:
        return self.at(end) - self.at(start)


# The server started with msgspec unimportable: the reference reader, as where the `fast` extra is not installed.
NO_MSGSPEC = (
    "import sys; sys.modules['msgspec'] = None; from broker_server.cli import app; app(prog_name='protofl-server')"
)
READERS = ("fast", "reference")
LOG_LEVELS = ("warning", "info")  # start's default (protofl.server at WARNING), and `start -v`


def setup_check_main(workload: str, reader: str) -> None:
    """Child process (the tree under test on its path): what the server of `workload` would read uploads with, and
    the versions it runs on, as JSON."""
    import importlib.metadata as md
    import sysconfig

    if reader == "reference":
        sys.modules["msgspec"] = None  # type: ignore[assignment]
    from protofl.wire import fast

    try:
        from broker_server.core.shell import decoder_limits

        fast_ok = fast.usable(decoder_limits(workload_config(workload, 2)))
    except ImportError:  # an older tree (a --baseline) lays its server out otherwise: msgspec importable is its test
        fast_ok = fast.available()

    def version(dist: str) -> str | None:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    config = str(sysconfig.get_config_var("CONFIG_ARGS") or "")
    print(
        json.dumps(
            {
                "reader": "fast" if fast_ok else "reference",
                "msgspec": version("msgspec") if fast.available() else None,
                "paho": version("paho-mqtt"),
                "numpy": version("numpy"),
                "python": f"{platform.python_implementation()} {platform.python_version()}",
                "python_build": ", ".join(
                    x for x in ("--enable-optimizations", "--with-lto", "--enable-shared") if x in config
                )
                or "no PGO/LTO flags",
            }
        )
    )


def server_setup(tree: Path, workload: str, reader: str, python: str = sys.executable) -> dict[str, Any]:
    """What `setup_check_main` says of `tree` (run by `python`), with the tree's git revision and the broker's
    version."""
    out = subprocess.run(
        [python, str(Path(__file__).resolve()), "--setup-check", workload, "--reader", reader],
        env=dict(os.environ, PYTHONPATH=_path(tree)),
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    info: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    rev = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    )
    info["tree"] = (rev.stdout.strip() or "?") + ("+changes" if dirty.stdout.strip() else "")
    mosq = subprocess.run(["mosquitto", "-h"], capture_output=True, text=True)
    info["mosquitto"] = next((w for w in (mosq.stdout + mosq.stderr).split() if w[:1].isdigit()), "?")
    return info


def setup_label(info: dict[str, Any]) -> str:
    """A row's reader path, log level and versions, in one cell."""
    return (
        f"{info['reader']} reader, log {info['log_level']}; {info['tree']}, {info['python']} "
        f"({info['python_build']}), msgspec {info['msgspec'] or '-'}, paho {info['paho']}, "
        f"mosquitto {info['mosquitto']}"
    )


def through_broker(
    tree: Path,
    workload: str,
    n: int,
    work: Path,
    shards: int = 0,
    reader: str = "fast",
    log_level: str = "warning",
    python: str = sys.executable,
) -> dict[str, Any]:
    """The real `protofl-server start` (its secured Mosquitto, generated credentials, the journal with fsync and
    group commit; with `shards`, `start --shards N`: N spawned shard processes on one shared subscription)
    federating n publisher devices for one round; then the same secured broker (its config, as start wrote it)
    delivering the same publisher's messages to mosquitto_sub. Both rates in uploads/s (a device's round uploads
    count as one, however many messages they take). `reader`: "reference" starts the server with msgspec
    unimportable; `log_level` "info": `start -v`; `python`: the server's interpreter (a baseline tree's own venv,
    whose installed entry points are that tree's)."""
    import socket

    from broker_server.ops.security import FederationSecrets, server_user

    fed, port, state = "benchagg", _free_port(), work / f"state-{workload}-{time.monotonic_ns()}"
    began = time.monotonic()

    def stage(what: str) -> None:  # progress of a long measurement (10,000 devices take minutes)
        print(
            f"  {workload}, {shards or 'no'} shards: {what} at {time.monotonic() - began:.1f} s",
            file=sys.stderr,
            flush=True,
        )

    bodies = work / f"bodies-{workload}-{time.monotonic_ns()}.bin"  # built once, read by each publisher
    built = device_bodies(workload_config(workload, n), 64, fed=fed)
    write_bodies(bodies, built)
    per_device = len(built[0])  # messages a device sends
    messages = n * per_device
    preset, values = workload_preset(workload)
    sets = [x for k, v in values.items() for x in ("--set", f"{k}={str(v).lower()}")]
    setup = server_setup(tree, workload, reader, python)
    setup["log_level"] = log_level
    server = subprocess.Popen(
        [
            python,
            *(["-c", NO_MSGSPEC] if reader == "reference" else ["-m", "broker_server.cli"]),
            "start",
            *(["-v"] if log_level == "info" else []),
            "--preset",
            preset,
            *sets,
            "--fed",
            fed,
            "--port",
            str(port),
            "--rounds",
            "1",
            "--min-clients",
            str(n),
            "--round-timeout",
            "600",
            "--state-dir",
            str(state),
            "--devices",
            str(n),
            *(["--shards", str(shards)] if shards else []),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONPATH=_path(tree)),
        cwd=tree,  # `-m` puts the working directory first on the path: run from ours, a baseline would run our code
    )
    creds = state / "security" / "devices"
    cpu = CpuSampler(server.pid)
    try:
        _wait_for(creds / f"device-{n}.json", 120, server)
        stage("credentials written")
        pub = _spawn_publisher(port, creds, bodies, n, fed, wait_round=True)
        out, _ = server.communicate(timeout=900)
        stage("the round closed")
        pub.communicate(timeout=60)
    finally:
        cpu.stop()
        if server.poll() is None:
            server.kill()
    if server.returncode != 0:
        raise RuntimeError(f"the server failed:\n{out[-3000:]}")
    rec = json.loads((state / "rounds.jsonl").read_text().splitlines()[0])
    if len(rec["clients"]) != n:
        raise RuntimeError(f"the round closed with {len(rec['clients'])} of {n} clients:\n{out[-3000:]}")
    aggregator = n / (rec["ended"] - rec["started"])
    # The server process's CPU seconds in the round; with shards the folding is in their processes, not this one.
    server_cpu = 0.0 if shards else cpu.between(rec["started"], rec["ended"])

    # The broker alone: the same secured config, the server's credentials on a C subscriber.
    secrets = FederationSecrets.from_json((state / "security" / "credentials.json").read_text(), "credentials.json")
    broker = subprocess.Popen(
        ["mosquitto", "-c", str(state / "broker" / "mosquitto.conf")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        end = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > end:
                    raise
                time.sleep(0.1)
        sub = subprocess.Popen(
            [
                "mosquitto_sub",
                "-h",
                "127.0.0.1",
                "-p",
                str(port),
                "-u",
                server_user(fed),
                "-P",
                secrets.server_password,
                "-q",
                "1",
                "-t",
                f"protofl/{fed}/up/+",
                "-C",
                str(n + messages),
                "-F",
                "%U",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(1.0)  # subscribed (a retained-free topic: nothing to wait for but the SUBACK)
        pub = _spawn_publisher(port, creds, bodies, n, fed, wait_round=False)
        stamps, _ = sub.communicate(timeout=300)
        pub.communicate(timeout=60)
        stage("mosquitto_sub read them")
        # The server's own MQTT transport on the same broker, doing nothing with what it reads; then bare paho.
        read_rates = {}
        for mode in ("--subscriber", "--raw-subscriber"):
            read_rates[mode] = _read_rate(mode, tree, port, fed, n, messages, creds, bodies, secrets.server_password)
            stage(f"{mode[2:]} read them")
    finally:
        for proc in (broker,):
            proc.terminate()
            proc.wait(timeout=10)
    times = [float(x) for x in stamps.split()][-messages:]  # the uploads (the joins came first)
    broker_rate = _per_device_rate(times, per_device)
    transport_rate = read_rates["--subscriber"]
    paho_rate = read_rates["--raw-subscriber"]
    return {
        "workload": workload,
        "uploads": n,
        "shards": shards,
        "setup": setup,
        "server_cpu_s_per_upload": server_cpu / n if server_cpu > 0 else None,
        "aggregator_uploads_per_s": aggregator,
        "aggregator_uploads_per_server_cpu_s": n / server_cpu if server_cpu > 0 else None,
        "broker_msgs_per_s": broker_rate,
        "ratio": aggregator / broker_rate,
        "transport_only_msgs_per_s": transport_rate,
        "transport_only_ratio": transport_rate / broker_rate,
        "paho_only_msgs_per_s": paho_rate,
        "paho_only_ratio": paho_rate / broker_rate,
    }


def _per_device_rate(stamps: list[float], per_device: int) -> float:
    """Uploads/s from the arrival times of the uploads' messages, `per_device` messages making one upload."""
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]) / per_device


def _read_rate(
    mode: str, tree: Path, port: int, fed: str, n: int, messages: int, creds: Path, bodies: Path, password: str
) -> float:
    """Uploads/s a reader child (`mode`: the server's transport, or bare paho) takes from the running broker:
    n joins, then `messages` upload messages."""
    reader = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).resolve()),
            mode,
            str(port),
            "--fed",
            fed,
            "--n",
            str(n),
            "--messages",
            str(messages),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=_path(tree), BENCH_PASSWORD=password),
    )
    assert reader.stdout is not None
    if reader.stdout.readline().strip() != "subscribed":
        raise RuntimeError(f"the {mode} reader did not subscribe")
    pub = _spawn_publisher(port, creds, bodies, n, fed, wait_round=False)
    stamps, _ = reader.communicate(timeout=300)
    pub.communicate(timeout=60)
    return _per_device_rate([float(x) for x in stamps.split()], messages // n)


def _line(res: dict[str, Any]) -> str:
    return (
        f"through the broker: aggregator {res['aggregator_uploads_per_s']:6.0f} uploads/s "
        f"({res['aggregator_uploads_per_server_cpu_s'] or 0:6.0f} per server CPU s), broker alone "
        f"{res['broker_msgs_per_s']:6.0f} uploads/s, ratio {res['ratio']:.2f}; the server's transport alone "
        f"{res['transport_only_msgs_per_s']:6.0f} uploads/s ({res['transport_only_ratio']:.2f}), bare paho "
        f"{res['paho_only_msgs_per_s']:6.0f} uploads/s ({res['paho_only_ratio']:.2f})"
    )


def broker_part(
    trees: dict[str, Path],
    workloads: list[str],
    n: int,
    repeats: int,
    shard_counts: tuple[int, ...] = (0,),
    readers: tuple[str, ...] = ("fast",),
    log_levels: tuple[str, ...] = ("warning",),
    pythons: dict[str, str] | None = None,
) -> dict[str, Any]:
    if shutil.which("mosquitto_sub") is None or shutil.which("mosquitto") is None:
        print("no mosquitto / mosquitto_sub: apt-get install -y mosquitto mosquitto-clients; part 2 skipped")
        return {}
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # the spawned broker inherits it
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 2 * n + 512)), hard))
    work = Path(tempfile.mkdtemp(prefix="bench-agg-broker-", dir=REPO))

    def setup(label: str, shards: int, reader: str, level: str) -> str:
        name = f"{label}, {shards} shards" if shards else label
        if len(readers) > 1 or len(log_levels) > 1:
            name += f", {reader} reader, log {level}"
        return name

    cases = [(s, rd, lv) for s in shard_counts for rd in readers for lv in log_levels]
    out: dict[str, Any] = {w: {setup(t, *c): [] for t in trees for c in cases} for w in workloads}
    try:
        for r in range(repeats):
            for w in workloads:
                for label, tree in trees.items():
                    for shards, reader, level in cases:
                        python = (pythons or {}).get(label, sys.executable)
                        res = through_broker(tree, w, n, work, shards, reader, level, python)
                        name = setup(label, shards, reader, level)
                        out[w][name].append(res)
                        print(f"repeat {r + 1}/{repeats} {w:>9} {name:>8} " + _line(res), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4000, help="devices (uploads) per measurement")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--baseline", type=Path, help="another tree (e.g. a worktree of main) to measure beside this one")
    ap.add_argument(
        "--baseline-python",
        help="the interpreter of the baseline's server in part 2 (a venv with that tree installed: an older tree "
        "refuses this venv's technique entry points); default: this one",
    )
    ap.add_argument(
        "--readers",
        action="store_true",
        help="in-process, also this tree with the reference upload reader (msgspec's turned off)",
    )
    ap.add_argument(
        "--journals",
        action="store_true",
        help="in-process, also this tree without the journal and with its fsync on (the group commit's cost)",
    )
    ap.add_argument("--out", type=Path, help="write the results as markdown here")
    ap.add_argument("--broker", action="store_true", help="also measure through the secured broker (part 2)")
    ap.add_argument("--broker-n", type=int, default=2000, help="devices per through-broker measurement")
    ap.add_argument("--broker-workloads", help="workloads of part 2 (default: --workloads)")
    ap.add_argument("--broker-repeats", type=int, help="repeats of part 2 (default: --repeats)")
    ap.add_argument(
        "--broker-shards",
        default="0",
        help="part 2 with `start --shards N` for each N of this comma list (0: one aggregator process)",
    )
    ap.add_argument("--skip-inprocess", action="store_true", help="part 2 only")
    ap.add_argument(
        "--broker-readers",
        default="fast",
        help="part 2's server reads uploads with: fast (msgspec, as installed), reference (msgspec unimportable), "
        "or both (fast,reference)",
    )
    ap.add_argument(
        "--broker-log",
        default="warning",
        help="the server's log level, warning (start's) or info (-v); part 2 takes a list (warning,info), part 1 "
        "the first",
    )
    ap.add_argument("--setup-check", help=argparse.SUPPRESS)
    ap.add_argument("--reader", default="fast", help=argparse.SUPPRESS)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--publisher", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--creds", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--bodies", type=Path, help=argparse.SUPPRESS)  # a publisher's: the devices' uploads
    ap.add_argument("--fed", default=FED, help=argparse.SUPPRESS)
    ap.add_argument("--wait-round", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--subscriber", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--raw-subscriber", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--messages", type=int, help=argparse.SUPPRESS)  # a reader's: the upload messages to read
    args = ap.parse_args()
    if args.setup_check:
        setup_check_main(args.setup_check, args.reader)
        return
    if args.raw_subscriber:
        raw_subscriber_main(args.raw_subscriber, args.fed, os.environ["BENCH_PASSWORD"], args.n, args.messages)
        return
    if args.subscriber:
        subscriber_main(args.subscriber, args.fed, os.environ["BENCH_PASSWORD"], args.n, args.messages)
        return
    if args.publisher:
        publisher_main(args.publisher, args.creds, args.bodies, args.n, args.fed, args.wait_round)
        return
    if args.worker:
        _worker(args)
        return
    trees = {"this": REPO}
    if args.baseline:
        trees = {"baseline": args.baseline.resolve(), **trees}
    if args.readers:
        trees[REFERENCE_READER] = REPO
    if args.journals:
        trees.update({label: REPO for label in JOURNALS})
    workloads = args.workloads.split(",")
    load = os.getloadavg()
    res: dict[str, Any] = {"command": " ".join(["python -m bench.bench_aggregator", *sys.argv[1:]])}
    if not args.skip_inprocess:
        res["inprocess"] = inprocess(trees, workloads, args.n, args.repeats, args.broker_log.split(",")[0])
    if args.broker:
        res["broker"] = broker_part(
            {k: v for k, v in trees.items() if k != REFERENCE_READER and k not in JOURNALS},
            (args.broker_workloads or args.workloads).split(","),
            args.broker_n,
            args.broker_repeats or args.repeats,
            tuple(int(x) for x in args.broker_shards.split(",")),
            tuple(x for x in args.broker_readers.split(",") if x in READERS) or ("fast",),
            tuple(x for x in args.broker_log.split(",") if x in LOG_LEVELS) or ("warning",),
            {"baseline": args.baseline_python} if args.baseline_python else None,
        )
    res["machine"] = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_avg_before": [round(x, 2) for x in load],
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
    }
    if "inprocess" in res:
        print(json.dumps(res["inprocess"]["median"], indent=1))
    if args.out:
        args.out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
        args.out.write_text(markdown(res))
        print(f"wrote {args.out} and {args.out.with_suffix('.json')}")


def markdown(res: dict[str, Any]) -> str:
    """The results as the AGGREGATOR.md tables (the prose around them is written by hand)."""
    lines = [
        f"Command: `{res['command']}`",
        "",
        f"Machine: {res['machine']['cpus']} cores, Python {res['machine']['python']}, load average (1/5/15 min) "
        f"{res['machine']['load_avg_before']} before, {res['machine']['load_avg_after']} after.",
    ]
    inp = res.get("inprocess", {"rates": {}})
    trees = list(next(iter(inp["rates"].values()), {}))
    if inp["rates"]:
        lines += [
            "",
            f"In-process, {inp['uploads']} uploads per measurement, median of {inp['repeats']} (uploads per "
            f"CPU second of the aggregator's process; all repeats in brackets; logging as `start` "
            f"{'-v' if inp.get('log_level') == 'info' else 'without -v'}; reader per column: "
            + ", ".join(f"{t} {inp.get('readers', {}).get(t, 'not recorded')}" for t in trees)
            + "; versions: "
            + "; ".join(
                f"{t}: {v['tree']}, {v['python']} ({v['python_build']}), msgspec {v['msgspec'] or '-'}, numpy "
                f"{v['numpy']}"
                for t, v in inp.get("setup", {}).items()
            )
            + "):",
            "",
            "| workload | upload bytes | " + " | ".join(trees) + (f" | this / {trees[0]} |" if len(trees) > 1 else ""),
            "|---|---|" + "---|" * len(trees) + ("---|" if len(trees) > 1 else ""),
        ]
    for w, per_tree in inp["rates"].items():
        cells = [f"{inp['median'][w][t]:,.0f} ({', '.join(f'{x:,.0f}' for x in per_tree[t])})" for t in trees]
        row = f"| {w} | {inp['upload_bytes'][w]:,} | " + " | ".join(cells) + " |"
        if len(trees) > 1:
            row += f" {inp['median'][w]['this'] / inp['median'][w][trees[0]]:.2f}x |"  # this tree against the first
        lines.append(row)
    broker = res.get("broker")
    if broker:
        lines += [
            "",
            "Through the secured broker (the `start` path, journal with fsync and group commit) beside the "
            "broker's own rate to mosquitto_sub, same run (uploads/s, wall clock):",
            "",
            "| workload | tree | aggregator | per server CPU s | broker alone | ratio | server's transport alone "
            "| its ratio | bare paho | its ratio | reader, log level, versions |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for w, per_tree in broker.items():
            for t, runs in per_tree.items():
                for r in runs:
                    per_cpu = r.get("aggregator_uploads_per_server_cpu_s")
                    lines.append(
                        f"| {w} | {t} | {r['aggregator_uploads_per_s']:,.0f} | "
                        f"{'-' if per_cpu is None else f'{per_cpu:,.0f}'} | {r['broker_msgs_per_s']:,.0f} "
                        f"| {r['ratio']:.2f} | {r.get('transport_only_msgs_per_s', 0):,.0f} | "
                        f"{r.get('transport_only_ratio', 0):.2f} | {r.get('paho_only_msgs_per_s', 0):,.0f} | "
                        f"{r.get('paho_only_ratio', 0):.2f} | "
                        f"{setup_label(r['setup']) if 'setup' in r else '(not recorded)'} |"
                    )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
