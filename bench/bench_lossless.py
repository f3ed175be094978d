"""Nothing lost at any size: N devices upload while the aggregator is paused; what the broker drops, and
whether the round still closes with every device.

    python -m bench.bench_lossless --devices 12000 --pause 3      # -> a table; --json FILE for the figures

The real server (`protofl-server start --broker URL`, journal in a state dir, this tree's code) runs
against a Mosquitto configured as `start` configures its own (broker.py), with the queue for the
aggregator each setup gives it. One MQTT connection plays the N devices (anonymous broker: one
connection may write every `up/<id>`): it sends N joins (paced, so that the joins themselves overflow
nothing), waits for the round message, the server is stopped (SIGSTOP), the N prototype uploads go
out and are all acknowledged by the broker, the server is paused `--pause` seconds more and continued.
The devices answer re-send requests on `down/<id>` (edge_agent/ops/resend.py) as a real device does,
except in the "old" setup, whose devices predate them. Setups, in this order in one run:

- old: the fixed `max_queued_messages 10000` every start had, devices that never re-send;
- fleet: the queue sized from the fleet (capacity.queue_for_fleet), what `start` now does;
- resend: the old 10000 queue again, with devices that answer re-send requests.

Per setup: uploads acknowledged by the broker, messages the broker dropped ($SYS), uploads the aggregator
folded, how the round closed and how long after the server was continued, and re-send requests.

    python -m bench.bench_lossless --credentials 10000            # a restart's credential step

times `start`'s credential step (security.prepare + provision, with a CA in every device file) for N
devices: the first start (every password hashed, every file written: what every restart cost before) and
then restarts (only what is new), alternating over fresh directories.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CLASSES, DIM = 10, 50  # a fedproto upload of 10 prototypes of 50 floats: about 2.1 KB on the wire


def run_setup(name: str, n: int, queue: int, resend: bool, pause: float, timeout: float) -> dict[str, Any]:
    from bench.bench_mqtt import FED, _payloads
    from broker_server.ops.broker import DROPPED_TOPIC, MosquittoBroker
    from edge_agent.ops.resend import ResendRequests
    from protofl import topics
    from protofl.transport.mqtt import MqttTransport
    from protofl.wire import read_header

    joins, ups = _payloads(n, CLASSES, DIM)
    ids = [f"d{i:05d}" for i in range(n)]
    index = {cid: i for i, cid in enumerate(ids)}
    with tempfile.TemporaryDirectory(prefix="bench-lossless-") as tmp:
        broker = MosquittoBroker(
            workdir=Path(tmp) / "broker", max_queued_messages=queue, persistence=False, die_with_parent=True
        ).start()
        state = Path(tmp) / "state"
        out = (Path(tmp) / "server.log").open("w")
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "broker_server.cli",
                "start",
                "--broker",
                broker.url,
                "--fed",
                FED,
                "--preset",
                "fedproto",
                "--rounds",
                "1",
                "--min-clients",
                str(n),
                "--round-timeout",
                str(timeout),
                "--state-dir",
                str(state),
                "--set",
                f"num_classes={CLASSES}",
                "--set",
                f"proto_dim={DIM}",
                "--connect-timeout",
                "30",
                "--broker-queue",
                str(queue),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONPATH=str(REPO)),
        )
        dropped: list[int] = []
        opened = threading.Event()
        requests = {"seen": 0, "answered": 0}
        readers: dict[str, ResendRequests] = {}
        devices = MqttTransport(broker.url, "bench-devices", deliver="thread")
        sysmon = MqttTransport(broker.url, "bench-sys", deliver="thread")
        stopped = False
        try:
            sysmon.connect(30)
            sysmon.subscribe(DROPPED_TOPIC, lambda t, p: dropped.append(int(p)))
            devices.connect(30)

            def on_round(topic: str, payload: bytes) -> None:
                if payload and read_header(payload).phase == "train":
                    opened.set()

            def on_request(topic: str, payload: bytes) -> None:
                requests["seen"] += 1
                cid = topic.rsplit("/", 1)[1]
                if not resend or cid not in index:
                    return  # an old device: it never subscribed, and the request is lost on it
                got = readers.setdefault(cid, ResendRequests(FED, cid)).read(payload, time.monotonic())
                if got is not None:
                    requests["answered"] += 1
                    msg = joins if got[1].ask == "join" else ups
                    devices.publish(topics.up(FED, cid), msg[index[cid]])

            waiting = threading.Event()
            devices.subscribe(topics.server_status(FED), lambda t, p: waiting.set() if p and b"waiting" in p else None)
            devices.subscribe(topics.round_(FED), on_round)
            devices.subscribe(f"{topics.ROOT}/{FED}/down/+", on_request)
            if not waiting.wait(120):  # the server subscribes before it says "waiting"; earlier joins are lost
                raise RuntimeError(f"{name}: the server did not start: {_tail(Path(tmp) / 'server.log')}")
            step = max(1, min(1000, queue // 4))
            for start in range(0, n, step):  # paced: a quarter of the queue per step, each step acknowledged
                for i in range(start, min(n, start + step)):
                    devices.publish(topics.up(FED, ids[i]), joins[i])
                devices.flush(120)
                time.sleep(0.3)
            if not opened.wait(120):
                raise RuntimeError(
                    f"{name}: round 1 did not open (joins lost? broker dropped {dropped[-1:]}): "
                    f"{_tail(Path(tmp) / 'server.log')} {_tail(broker.log_path)}"
                )
            os.kill(server.pid, signal.SIGSTOP)
            stopped = True
            t0 = time.monotonic()
            for i, p in enumerate(ups):
                devices.publish(topics.up(FED, ids[i]), p)
            acked = devices.flush(300)
            time.sleep(pause)
            paused = time.monotonic() - t0
            os.kill(server.pid, signal.SIGCONT)
            stopped = False
            continued = time.time()
            _until_closed_or_drained(server, state, continued + timeout, n, dropped, resend)
            if server.poll() is None:
                server.send_signal(signal.SIGTERM)
                server.wait(60)
            status = json.loads((state / "status.json").read_text())
            dropping = sorted(
                {
                    line.rsplit(" ", 1)[1].rstrip(".")
                    for line in broker.log_path.read_text().splitlines()
                    if "Outgoing messages are being dropped for client" in line
                }
            )
            rounds = (
                [json.loads(x) for x in (state / "rounds.jsonl").read_text().splitlines()]
                if (state / "rounds.jsonl").exists()
                else []
            )
        finally:
            if os.environ.get("BENCH_KEEP_LOGS"):
                import shutil

                keep = Path(os.environ["BENCH_KEEP_LOGS"])
                keep.mkdir(parents=True, exist_ok=True)
                shutil.copy(Path(tmp) / "server.log", keep / f"{name}-server.log")
                shutil.copy(broker.log_path, keep / f"{name}-mosquitto.log")
            if stopped:
                os.kill(server.pid, signal.SIGCONT)
            if server.poll() is None:
                server.kill()
            out.close()
            devices.close()
            sysmon.close()
            broker.cleanup()
    rec = rounds[0] if rounds else None
    return {
        "setup": name,
        "devices": n,
        "queue": queue,
        "paused_s": round(paused, 1),
        "uploads_acked": n if acked else None,
        "broker_dropped": (dropped[-1] - dropped[0]) if len(dropped) > 1 else 0,
        "folded": status["accepted"].get("protos", 0),
        "closed_by": rec["closed_by"] if rec else f"not closed ({timeout:.0f} s deadline, floor {n})",
        "close_after_continue_s": round(rec["ended"] - continued, 1) if rec else None,
        "clients": len(rec["clients"]) if rec else status["accepted"].get("protos", 0),
        "resend_requests": status.get("resend_requests", 0),
        "answered": requests["answered"],
        "dropping_for": dropping,
    }


def _until_closed_or_drained(
    server: subprocess.Popen[bytes],
    state: Path,
    deadline: float,
    n: int,
    dropped: list[int],
    resend: bool,
    limit: float = 1800.0,
) -> None:
    """Until the round closed (the server exits), or (devices that do not re-send) its deadline passed and the
    server folded everything the broker kept (N minus what it dropped: a round short of its floor waits for
    ever), or nothing was folded for 120 s."""
    end, last, changed = time.monotonic() + limit, -1, time.time()
    while server.poll() is None and time.monotonic() < end:
        try:
            folded = json.loads((state / "status.json").read_text())["accepted"].get("protos", 0)
        except (OSError, ValueError, KeyError):
            folded = last
        if folded != last:
            last, changed = folded, time.time()
        lost = dropped[-1] - dropped[0] if len(dropped) > 1 else 0
        if time.time() > deadline and ((not resend and folded + lost >= n) or time.time() - changed > 120):
            return
        time.sleep(0.5)


def credentials_cost(n: int, repeat: int = 3) -> dict[str, Any]:
    from broker_server.ops.security import prepare

    ids = [f"device-{i}" for i in range(1, n + 1)]
    ca = "-----BEGIN CERTIFICATE-----\n" + "A" * 600 + "\n-----END CERTIFICATE-----\n"
    first: list[float] = []
    again: list[float] = []
    for _ in range(repeat):
        with tempfile.TemporaryDirectory(prefix="bench-creds-") as tmp:
            for times in (first, again):
                t0 = time.perf_counter()
                prepare(Path(tmp), "bench", ids).provision(ca)
                times.append(time.perf_counter() - t0)
    return {
        "devices": n,
        "first_start_s": round(min(first), 2),
        "restart_s": round(min(again), 3),
        "first_all_s": [round(t, 2) for t in first],
        "restart_all_s": [round(t, 3) for t in again],
    }


def _tail(path: Path, n: int = 1500) -> str:
    return path.read_text(errors="replace")[-n:]


def main() -> None:
    from broker_server.ops.capacity import DEFAULT_QUEUE, queue_for_fleet

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=12_000)
    ap.add_argument("--pause", type=float, default=3.0, help="seconds the server stays stopped after the uploads")
    ap.add_argument("--timeout", type=float, default=60.0, help="the round's deadline (the old setup waits it out)")
    ap.add_argument("--setups", default="old,fleet,resend")
    ap.add_argument(
        "--old-queue",
        type=int,
        default=DEFAULT_QUEUE,
        help="the fixed queue of old and resend (a smaller one shows the same at fewer devices)",
    )
    ap.add_argument("--json", type=Path)
    ap.add_argument("--credentials", type=int, help="time the credential step for this many devices instead")
    args = ap.parse_args()
    if args.credentials:
        print(json.dumps(credentials_cost(args.credentials)))
        return
    n = args.devices
    plan = {"old": (args.old_queue, False), "fleet": (queue_for_fleet(n, 1), True), "resend": (args.old_queue, True)}
    rows = []
    for name in args.setups.split(","):
        queue, resend = plan[name]
        row = run_setup(name, n, queue, resend, args.pause, args.timeout)
        print(json.dumps(row), flush=True)
        rows.append(row)
    cols = [
        "setup",
        "devices",
        "queue",
        "paused_s",
        "broker_dropped",
        "folded",
        "closed_by",
        "close_after_continue_s",
        "resend_requests",
        "answered",
    ]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in cols) + " |")
    if args.json:
        args.json.write_text(
            json.dumps({"rows": rows, "machine": os.uname().nodename, "cpus": os.cpu_count()}, indent=2)
        )


if __name__ == "__main__":
    main()
