"""Which MQTT client reads a server's uploads fastest in Python (issue 48): paho against the others, one run.

    python -m bench.bench_readers --n 20000 --repeats 3

A plain local Mosquitto (no TLS, no auth: the readers are measured, not the security) and one reader at a time, each in
a process of its own: it subscribes at QoS 1 to `bench/READER/+` with a persistent session and goes away; a C publisher
(`mosquitto_pub --repeat N`, QoS 1, 2,218-byte payloads: a tinyproto upload's size) queues N messages for it; the
reader comes back and drains them (so no publisher paces it). The rate is messages over the time from the first to
the last arrival. The readers, interleaved in each repeat:
- `mosquitto_sub`: the C client (the broker's own rate to a reader);
- `paho`: one paho-mqtt connection (MQTT 5), its network thread acknowledging at once, a callback that counts;
- `paho-shared-K`: K paho connections in one process on one shared subscription (`$share/bench/bench/up/+`),
  each with its network thread;
- `gmqtt`: gmqtt's asyncio client (MQTT 5), where it is installed;
- `amqtt`: amqtt's asyncio client (MQTT 3.1.1), where it is installed;
- `transport`: the server's own `MqttTransport` (deliver="pump", acknowledging after each pumped batch).
A reader that is not installed is skipped (said so). Results beside the load average.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

PATTERN = "bench/up/+"  # each reader's own: bench/READER/+ (`_own`), so no session queues another's messages
PAYLOAD = 2218


def _done(stamps: list[float], n: int) -> None:
    print(f"{(n - 1) / (stamps[-1] - stamps[0]):.1f}", flush=True)


EXPIRY = 600  # the readers' sessions: kept by the broker while the messages are queued for them


def read_paho(port: int, n: int, connections: int, prime: bool) -> None:
    import paho.mqtt.client as paho
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    got: list[float] = []
    lock = threading.Lock()
    finished = threading.Event()

    def on_message(client: Any, userdata: Any, msg: Any) -> None:
        with lock:
            got.append(time.perf_counter())
            if len(got) >= n:
                finished.set()

    subscribed = threading.Semaphore(0)
    pattern = PATTERN if connections == 1 else f"$share/bench/{PATTERN}"
    clients = []
    for i in range(connections):
        c = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=f"reader-p{connections}-{i}", protocol=paho.MQTTv5)
        c.on_message = on_message
        c.on_subscribe = lambda *a: subscribed.release()
        if prime:
            c.on_connect = lambda client, *a: client.subscribe(pattern, qos=1)
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = EXPIRY
        c.connect("127.0.0.1", port, clean_start=False, properties=props)
        c.loop_start()
        clients.append(c)
    if prime:
        for _ in clients:
            subscribed.acquire()
    else:
        finished.wait()
        _done(got, n)
    for c in clients:
        c.disconnect()
        c.loop_stop()


def read_gmqtt(port: int, n: int, prime: bool) -> None:
    import asyncio

    from gmqtt import Client  # type: ignore[import-untyped,import-not-found,unused-ignore]

    async def main() -> None:
        got: list[float] = []
        finished = asyncio.Event()
        c = Client("reader-g", clean_session=False, session_expiry_interval=EXPIRY)

        def on_message(client: Any, topic: str, payload: bytes, qos: int, properties: Any) -> int:
            got.append(time.perf_counter())
            if len(got) >= n:
                finished.set()
            return 0

        c.on_message = on_message
        await c.connect("127.0.0.1", port)
        if prime:
            c.subscribe(PATTERN, qos=1)
            await asyncio.sleep(0.5)  # its SUBACK (gmqtt has no awaitable subscribe)
        else:
            await finished.wait()
            _done(got, n)
        await c.disconnect()

    asyncio.run(main())


def read_amqtt(port: int, n: int, prime: bool) -> None:
    import asyncio

    from amqtt.client import MQTTClient

    async def main() -> None:
        got: list[float] = []
        c = MQTTClient(client_id="reader-a")
        await c.connect(f"mqtt://127.0.0.1:{port}/", cleansession=False)
        if prime:
            await c.subscribe([(PATTERN, 1)])
        else:
            while len(got) < n:
                await c.deliver_message()
                got.append(time.perf_counter())
            _done(got, n)
        await c.disconnect()

    asyncio.run(main())


def read_transport(port: int, n: int, prime: bool) -> None:
    from protofl.transport.mqtt import MqttTransport

    got: list[float] = []
    t = MqttTransport(
        f"mqtt://127.0.0.1:{port}",
        "reader-t",
        deliver="pump",
        manual_ack=True,
        persistent_session=True,
        resume_session=not prime,
        session_expiry=EXPIRY,
    )
    t.before_ack = lambda: None
    t.connect(10)
    t.subscribe(PATTERN, lambda _topic, _payload: got.append(time.perf_counter()))
    if prime:
        t.flush(5)
        time.sleep(0.5)  # the SUBACK: the transport's subscribe does not wait for it
    else:
        while len(got) < n:
            t.pump(0.5)
        _done(got, n)
    t.close()


def read_mosquitto_sub(port: int, n: int, prime: bool) -> None:
    args = ["mosquitto_sub", "-h", "127.0.0.1", "-p", str(port), "-q", "1", "-t", PATTERN, "-c", "-i", "reader-s"]
    args += ["-V", "mqttv5", "-x", str(EXPIRY)]
    if prime:
        subprocess.run([*args, "-E"], check=True, stdout=subprocess.DEVNULL)
        return
    out = subprocess.run([*args, "-C", str(n), "-F", "%U"], check=True, capture_output=True, text=True).stdout
    _done([float(x) for x in out.split()], n)


def available(name: str) -> bool:
    mod = {"gmqtt": "gmqtt", "amqtt": "amqtt"}.get(name)
    if mod is None:
        return True
    try:
        __import__(mod)
    except ImportError:
        return False
    return True


def measure(reader: str, port: int, n: int, payload: Path) -> float:
    """Prime the reader's session (subscribed, then away), queue n messages for it, then time its drain."""
    cmd = [sys.executable, "-m", "bench.bench_readers", "--reader", reader, "--port", str(port), "--n", str(n)]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    subprocess.run([*cmd, "--prime"], check=True, env=env, timeout=60)
    topic = f"bench/{reader}/dev"
    pub = ["mosquitto_pub", "-h", "127.0.0.1", "-p", str(port), "-q", "1", "-t", topic, "-f", str(payload)]
    subprocess.run([*pub, "--repeat", str(n)], check=True, timeout=600)
    out = subprocess.run(cmd, check=True, env=env, timeout=600, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--readers", default="mosquitto_sub,paho,paho-shared-2,paho-shared-4,gmqtt,amqtt,transport")
    ap.add_argument("--reader", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--prime", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.reader:
        r = args.reader
        global PATTERN
        PATTERN = f"bench/{r}/+"
        if r == "paho" or r.startswith("paho-shared-"):
            read_paho(args.port, args.n, 1 if r == "paho" else int(r.rsplit("-", 1)[1]), args.prime)
        elif r == "gmqtt":
            read_gmqtt(args.port, args.n, args.prime)
        elif r == "amqtt":
            read_amqtt(args.port, args.n, args.prime)
        elif r == "transport":
            read_transport(args.port, args.n, args.prime)
        else:
            read_mosquitto_sub(args.port, args.n, args.prime)
        return
    from broker_server.ops.broker import free_port

    if shutil.which("mosquitto_sub") is None or shutil.which("mosquitto_pub") is None:
        raise SystemExit("needs mosquitto_sub and mosquitto_pub (Debian's mosquitto-clients)")
    readers = [r for r in args.readers.split(",") if available(r) or print(f"{r}: not installed, skipped")]
    work = Path(tempfile.mkdtemp(prefix="bench-readers-"))
    port = free_port()
    (work / "payload").write_bytes(os.urandom(PAYLOAD))
    (work / "m.conf").write_text(
        f"listener {port} 127.0.0.1\nallow_anonymous true\nmax_queued_messages {2 * args.n}\nmax_queued_bytes 0\n"
        + ("user root\n" if os.geteuid() == 0 else "")
    )
    broker = subprocess.Popen(["mosquitto", "-c", str(work / "m.conf")], stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    print(f"load average before {os.getloadavg()}, {os.cpu_count()} cpus, n={args.n}", flush=True)
    rates: dict[str, list[float]] = {r: [] for r in readers}
    try:
        for rep in range(args.repeats):
            for r in readers:
                rates[r].append(measure(r, port, args.n, work / "payload"))
                print(f"repeat {rep + 1} {r:>14}: {rates[r][-1]:9,.0f} msgs/s", flush=True)
    finally:
        broker.terminate()
        broker.wait(10)
        shutil.rmtree(work, ignore_errors=True)
    print(f"load average after {os.getloadavg()}")
    base = statistics.median(rates["paho"]) if rates.get("paho") else None
    print("| reader | msgs/s, median (repeats) | / paho |\n|---|--:|--:|")
    for r, v in rates.items():
        med = statistics.median(v)
        rel = f"{med / base:.2f}" if base else "-"
        print(f"| {r} | {med:,.0f} ({', '.join(f'{x:,.0f}' for x in v)}) | {rel} |")


if __name__ == "__main__":
    main()
