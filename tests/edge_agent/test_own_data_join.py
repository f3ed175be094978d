"""A device that brings its own data joins a federation whose config is the truth about classes and shape:
any subset of the classes, its own test split counted as given, errors that say what the federation expects.
The data is written by the test; the brokers are real (mosquitto)."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from broker_server.ops.broker import MosquittoBroker, free_port
from broker_server.service import AggregatorService, server_transport
from broker_server.settings import Broker, Federation
from edge_agent.ops.local_data import DataSpec, dataset_spec, load_client_data
from edge_agent.ops.runner import DeviceRunner, RunnerOptions
from protofl import topics
from protofl.data import Dataset, make_synthetic
from protofl.errors import DataError
from protofl.presets import make_config
from protofl.transport.broker_url import parse_broker_url
from protofl.transport.mqtt import MqttTransport
from protofl.wire import Metrics, decode_message
from tests.broker_server.mqtt_helpers import ServiceThread, fast_backoff
from tests.conftest import EVENT_WAIT_S, _require_mosquitto

REPO = Path(__file__).resolve().parents[2]
SHAPE = (1, 16, 16)
TRAIN, TEST = make_synthetic(num_classes=10, n_train=1000, n_test=400, shape=SHAPE, seed=5)


def device_npz(path: Path, classes: list[int], per_class: int = 20, test_per_class: int = 7) -> tuple[int, int]:
    """An npz holding only `classes` of the 10-class synthetic task, with its own test split; (n, n_test)."""

    def take(ds: Dataset, k: int) -> tuple[np.ndarray, np.ndarray]:
        idx = np.concatenate([np.flatnonzero(ds.y == c)[:k] for c in classes])
        return ds.x[idx], ds.y[idx]

    x, y = take(TRAIN, per_class)
    x_test, y_test = take(TEST, test_per_class)
    np.savez(path, x=x, y=y, x_test=x_test, y_test=y_test)
    return len(y), len(y_test)


def test_a_device_with_six_of_ten_classes_loads_its_own_test_split(tmp_path: Path) -> None:
    cfg = make_config("fedproto", num_classes=10, in_shape=SHAPE)
    n, n_test = device_npz(tmp_path / "dev.npz", [0, 1, 2, 3, 4, 5])
    data = load_client_data(DataSpec(f"npz:{tmp_path / 'dev.npz'}"), cfg, "rpi-01")
    assert (len(data.y_train), len(data.y_test)) == (n, n_test) == (120, 42)  # as given: no re-split
    assert set(data.y_train.tolist()) == set(range(6)) and data.x_train.shape[1:] == SHAPE
    # Without a test split the device holds back 25 % once: 120 -> 90 + 30.
    np.savez(tmp_path / "plain.npz", x=TRAIN.x[:120], y=TRAIN.y[:120])
    data = load_client_data(DataSpec(str(tmp_path / "plain.npz")), cfg, "rpi-01")
    assert (len(data.y_train), len(data.y_test)) == (90, 30)
    # The federation says what is wrong: its classes, its shape.
    with pytest.raises(DataError, match=r"label 5 out of range for 4 classes: the federation expects 4 classes"):
        load_client_data(DataSpec(f"npz:{tmp_path / 'dev.npz'}"), cfg.replace(num_classes=4), "rpi-01")
    with pytest.raises(DataError, match=r"images are \(1, 16, 16\).*federation expects in_shape \(3, 32, 32\)"):
        load_client_data(DataSpec(f"npz:{tmp_path / 'dev.npz'}"), cfg.replace(in_shape=(3, 32, 32)), "rpi-01")


def test_data_paths_map_to_specs_and_missing_ones_are_not_found(tmp_path: Path) -> None:
    (tmp_path / "t.csv").write_text("label,a\n0,1\n")
    assert dataset_spec(str(tmp_path / "t.csv")) == f"csv:{tmp_path / 't.csv'}"
    (tmp_path / "imgs" / "cat").mkdir(parents=True)
    assert dataset_spec(str(tmp_path / "imgs")) == f"imagefolder:{tmp_path / 'imgs'}"
    assert dataset_spec("mytrial.data:load") == "mytrial.data:load"
    for missing in (
        str(tmp_path / "gone.npz"),
        f"npz:{tmp_path / 'gone.npz'}",
        f"imagefolder:{tmp_path / 'gone'}",
        f"csv:{tmp_path / 'gone.csv'},label=y",
    ):
        with pytest.raises(DataError, match=rf"not found: {tmp_path}/gone"):
            dataset_spec(missing)


@pytest.mark.mosquitto
def test_a_subset_device_joins_and_trains_in_process(mosquitto: MosquittoBroker, tmp_path: Path) -> None:
    fed = "own"
    opts = parse_broker_url(mosquitto.url)
    n, n_test = device_npz(tmp_path / "dev.npz", [0, 1, 2, 3, 4, 5])
    metrics: list[Metrics] = []
    spy = MqttTransport(opts, "spy", backoff=fast_backoff()).connect(10)
    spy.subscribe(
        topics.up(fed, "rpi-01"),
        lambda t, p: metrics.append(m) if isinstance(m := decode_message(p)[1], Metrics) else None,
    )
    cfg = make_config("fedproto", num_classes=10, in_shape=SHAPE, rounds=2, min_clients=1)
    service = AggregatorService(Federation(cfg, fed), server_transport(Broker(opts), fed))
    server = ServiceThread(service, timeout=60).start()
    device = DeviceRunner(opts, fed, "rpi-01", DataSpec(f"npz:{tmp_path / 'dev.npz'}"), RunnerOptions())
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(device.run, timeout=60)
        server.join(60)
        agent = running.result(EVENT_WAIT_S)
    service.close()
    spy.close()
    assert agent is not None and agent.finished and agent.stats.rounds_trained == 2
    assert [m.n_local for m in metrics] == [n_test, n_test]  # its own test split, as given
    assert all(np.isfinite(m.loss) and m.loss > 0 for m in metrics)  # it trained (no accuracy claim: 2 short rounds)


@pytest.mark.slow
@pytest.mark.mosquitto
def test_start_and_join_with_devices_holding_three_to_six_classes(tmp_path: Path) -> None:
    # A 10-class federation over `protofl-server start` (its own mosquitto) and three `protofl-edge join`
    # processes, each with its own npz: 6, 3 and 5 of the classes, with its own test split.
    _require_mosquitto()  # `start --local-broker mosquitto` runs it: fail (or skip, as configured) without it
    holdings = {"dev-a": [0, 1, 2, 3, 4, 5], "dev-b": [6, 7, 8], "dev-c": [5, 6, 7, 8, 9]}
    counts = {d: device_npz(tmp_path / f"{d}.npz", cls) for d, cls in holdings.items()}
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "broker_server.cli",
            "start",
            "--local-broker",
            "mosquitto",
            "--insecure",
            "--port",
            str(port),
            "--fed",
            "owntrial",
            "--preset",
            "fedproto",
            "--rounds",
            "2",
            "--min-clients",
            "3",
            "--round-timeout",
            "60",
            "--set",
            "num_classes=10",
            "--set",
            "in_shape=1,16,16",
            "--state-dir",
            str(tmp_path / "state"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        text=True,
    )
    metrics: dict[str, list[int]] = {}
    spy = MqttTransport(parse_broker_url(f"mqtt://127.0.0.1:{port}"), "spy", backoff=fast_backoff()).connect(30)

    def on_up(topic: str, payload: bytes) -> None:
        msg = decode_message(payload)[1]
        if isinstance(msg, Metrics):
            metrics.setdefault(topics.client_of(topic), []).append(msg.n_local)

    spy.subscribe(f"{topics.ROOT}/owntrial/up/+", on_up)
    devices = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "edge_agent.cli",
                "join",
                "--broker",
                f"mqtt://127.0.0.1:{port}",
                "--fed",
                "owntrial",
                "--client-id",
                d,
                "--data",
                str(tmp_path / f"{d}.npz"),
                "--threads",
                "1",
                "--connect-timeout",
                "60",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            text=True,
        )
        for d in holdings
    ]
    try:
        out, _ = server.communicate(timeout=120)
        dev_out = [p.communicate(timeout=60)[0] for p in devices]
    finally:
        spy.close()
        for p in (server, *devices):
            if p.poll() is None:
                p.kill()
    assert server.returncode == 0, out
    assert "round 2/2: 3 clients" in out and "federation 'owntrial' finished: 2 rounds" in out, out
    for p, o in zip(devices, dev_out, strict=True):
        assert p.returncode == 0, o
    assert {d: ns for d, ns in metrics.items()} == {d: [n_test, n_test] for d, (_, n_test) in counts.items()}
