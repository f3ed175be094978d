"""A decompression bomb in a device's image folder (issue 43): `join` skips it with the other unreadable files
and trains, where today Pillow's DecompressionBombError escaped the config handler and the device idled connected
forever. Real `start` (its own mosquitto) and a real `join`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from broker_server.ops.broker import MosquittoBroker
from tests.protofl.test_crafted_files import bomb_png


@pytest.mark.slow
@pytest.mark.mosquitto
def test_join_skips_a_decompression_bomb_and_trains(tmp_path: Path) -> None:
    from tests.broker_server.mqtt_helpers import start_and_join
    from tests.conftest import _require_mosquitto

    _require_mosquitto()
    rng = np.random.default_rng(0)
    imgs = tmp_path / "imgs"
    for k, name in enumerate(["ant", "bee", "cat"]):
        (imgs / name).mkdir(parents=True)
        for i in range(8):
            px = np.clip(k * 90 + rng.integers(-20, 20, (16, 16, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(px, "RGB").save(imgs / name / f"{i}.png")
    bomb_png(imgs / "bee" / "bomb.png")  # 50000x50000 claimed: Pillow's DecompressionBombError
    code, dev_out, server_code, out = start_and_join(tmp_path, "bomb43", f"imagefolder:{imgs}")
    assert code is not None, f"join neither trained nor exited within 120 s: {dev_out[-3000:]}"
    assert code == 0, dev_out
    assert server_code == 0, out
    said = " ".join(dev_out.split())
    assert "loaded 24 image(s); skipped 1: bee/bomb.png (too large to decode" in said, dev_out
    assert "Traceback" not in dev_out, dev_out


@pytest.mark.mosquitto
def test_a_device_whose_config_handler_fails_leaves_with_an_error(
    mosquitto: MosquittoBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any failure handling the first config (here an unexpected RuntimeError while loading the data) ends
    `run` with a ConfigError naming it (`join` exits 2), never a device that idles connected (today: the
    transport logged the traceback and the device waited until its timeout)."""
    import time

    from broker_server.service import AggregatorService, server_transport
    from broker_server.settings import Broker, Federation
    from broker_server.simulation import SimulationSpec, prepare
    from edge_agent.ops.local_data import DataSpec
    from edge_agent.ops.runner import DeviceRunner, RunnerOptions
    from protofl.errors import ConfigError
    from protofl.transport.broker_url import parse_broker_url
    from tests.broker_server.mqtt_helpers import ServiceThread

    data, fed = "synthetic:n=200,n_test=50", "failing"

    def broken(self: DeviceRunner, read: object) -> None:
        raise RuntimeError("Pillow blew up")

    monkeypatch.setattr(DeviceRunner, "_build_agent", broken)
    opts = parse_broker_url(mosquitto.url)
    cfg = prepare(SimulationSpec(preset="tinyproto", dataset=data, clients=1, rounds=1, seed=3)).cfg
    service = AggregatorService(Federation(cfg.replace(min_clients=1), fed), server_transport(Broker(opts), fed))
    server = ServiceThread(service, timeout=30).start()
    device = DeviceRunner(opts, fed, "client-000", DataSpec(data), RunnerOptions())
    t0 = time.monotonic()
    try:
        with pytest.raises(
            ConfigError, match=r"handling the federation config failed \(RuntimeError: Pillow blew up\)"
        ):
            device.run(timeout=25)
    finally:
        service.stop()  # it waits for a device that left: stopped, not joined
        server.thread.join(10)
        service.close()
    assert time.monotonic() - t0 < 20
