"""Buffered asynchronous rounds (FedBuff, issue 47): uploads of mixed versions folded with the stated weights
(w(s) = 1/sqrt(1 + s), hand-computed below), a new global state every K uploads, stale past the bound dropped;
and a restart after any message (and a real kill -9 of `protofl-server start`) ends in the same state."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from broker_server.core.shell import Aggregator
from protofl import topics
from protofl.algorithms.robust import ClipPolicy
from protofl.errors import ConfigError
from protofl.presets import make_config
from protofl.sparse import SparseVector
from protofl.transport import InProcessBroker
from protofl.wire import Join, ParamsUpload, ProtoSet, ProtoUpload, decode_message, encode_message
from tests.broker_server import test_durability as durability
from tests.pipelines import ADAPTER_PIPELINE

FED = durability.FED
CLIENTS = durability.CLIENTS
A, B, C = CLIENTS
W1 = 1 / math.sqrt(2)  # the weight of an upload one version old


def _cfg(**extra: Any) -> Any:
    return make_config(
        "protofl", rounds=3, min_clients=3, num_classes=3, proto_dim=20, adapter_rank=2, seed=3,
        buffer_k=2, staleness_bound=1, **ADAPTER_PIPELINE, **extra,
    )  # fmt: skip


def _aggregator(state: Path | None = None, broker: InProcessBroker | None = None) -> tuple[Aggregator, Any]:
    """The durability tests' aggregator (three clients a, b, c), asynchronous, clipping off (exact sums)."""
    return durability._aggregator("", state, broker, cfg=_cfg(), policy=ClipPolicy(enabled=False))


def _upload(agg: Aggregator, client: str, version: int, value: float) -> list[tuple[str, bytes]]:
    """`client`'s two uploads trained from `version`: class 0's prototype (CPS-scaled: its s values all `value`)
    and its adapter's coordinate 0 = `value` (APUD: 10 samples)."""
    width, n = agg.machine.plan.proto_width, agg.model.rules.state_values()["adapter"].shape[0]
    protos = ProtoSet(classes=np.array([0]), values=np.full((1, width), value, np.float32), dt="f4")
    adapter = SparseVector(n, np.array([0]), np.array([value], np.float32))
    return [
        (topics.up(FED, client), encode_message(m, fed=FED, sender=client, round=version, phase="train"))
        for m in (ProtoUpload(local=protos, public=None, n_samples=10), ParamsUpload(adapter, 10, version))
    ]


def _script(agg: Aggregator) -> list[tuple[str, bytes]]:
    joins = [(topics.up(FED, c), encode_message(Join(arch="", n_samples=10), fed=FED, sender=c)) for c in CLIENTS]
    return joins + [
        *_upload(agg, A, 1, 1.0),
        *_upload(agg, B, 1, 3.0),  # K = 2: version 2 (mean 2.0)
        *_upload(agg, C, 1, 4.0),  # one version old: weight 1/sqrt(2)
        *_upload(agg, A, 2, 0.0),  # K = 2: version 3 = (w 4 + 0) / (w + 1) for the adapter (n-weighted)
        *_upload(agg, C, 1, 9.0),  # two versions old, past staleness_bound 1: dropped
        *_upload(agg, B, 2, 5.0),  # one version old in version 3
        *_upload(agg, C, 3, 1.0),  # K = 2: the last version
    ]


def _state(agg: Aggregator) -> tuple[bytes, bytes, int]:
    v = agg.model.rules.state_values()
    return v["adapter"].tobytes(), v["prototypes"][0].tobytes(), agg.round


def test_mixed_versions_are_folded_with_the_stated_weights_and_a_version_every_k_uploads() -> None:
    broker = InProcessBroker()
    published: list[int] = []
    watcher = broker.connect("watcher")
    watcher.subscribe(topics.round_(FED), lambda t, p: published.append(decode_message(p)[0].round))
    agg, _ = _aggregator(broker=broker)
    script = _script(agg)
    adapter0 = float(agg.model.rules.state_values()["adapter"][0])
    rounds_after: list[int] = []
    for topic, payload in script:
        broker.connect("dev").publish(topic, payload)
        broker.pump()
        rounds_after.append(agg.round)
        if agg.round == 2 and len(rounds_after) == 3 + 4:  # version 2 just opened
            v = agg.model.rules.state_values()
            assert v["adapter"][0] == pytest.approx(2.0)  # (10 x 1 + 10 x 3) / 20
            assert v["prototypes"][0] == pytest.approx(np.full(v["prototypes"][0].shape, 2.0))  # (1 + 3) / 2
        if len(rounds_after) == 3 + 8:  # version 3 just opened: c's stale upload folded at w = 1/sqrt(2)
            v = agg.model.rules.state_values()
            assert agg.round == 3
            assert v["adapter"][0] == pytest.approx(4 * W1 / (W1 + 1))  # (w 10 x 4 + 10 x 0) / (w 10 + 10)
            assert v["prototypes"][0][0] == pytest.approx(4 * W1 / 2)  # scaled sums: (w 4 + 0) / 2 senders
    # A new version after every K = 2 accepted uploads (pairs of messages), never in between.
    assert rounds_after[3:] == [1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3]
    assert agg.finished and [r.round for r in agg.records] == [1, 2, 3]
    assert agg.dropped == {"stale": 2}  # c's two-versions-old protos and adapter
    assert [r.staleness for r in agg.records] == [{}, {f"{C}@1": 1}, {f"{B}@2": 1}]
    assert [r.closed_by for r in agg.records] == ["buffer", "buffer", "buffer"]
    v = agg.model.rules.state_values()
    assert v["adapter"][0] == pytest.approx((W1 * 5 + 1) / (W1 + 1))  # version 3's last buffer: b@2 and c@3
    assert published == [1, 2, 3, 3] and adapter0 != v["adapter"][0]  # versions 1-3, then the final message


def test_a_restart_after_any_message_ends_in_the_same_state(tmp_path: Path) -> None:
    ref, _ = _aggregator()
    script = _script(ref)
    for t, p in script:
        ref.on_message(t, p)
    assert ref.finished
    live, durable = _aggregator(tmp_path / "live")
    cuts = durability.feed_and_cut(live, script, tmp_path)
    assert durable is not None
    durable.close()
    for i, cut in enumerate(cuts):
        agg, d = _aggregator(cut)
        for t, p in script[i:]:  # the last one was perhaps not acknowledged: delivered again
            agg.on_message(t, p)
        assert agg.finished and _state(agg) == _state(ref), f"restart after message {i}"
        assert [r.staleness for r in agg.records] == [r.staleness for r in ref.records]
        d.close()


def test_async_needs_one_phase_and_one_aggregator() -> None:
    with pytest.raises(ConfigError, match="needs a plan of one phase"):
        Aggregator(
            make_config("protofl", buffer_k=2, **dict(ADAPTER_PIPELINE, erpa=True, public_classes=(0,))),
            FED, InProcessBroker().connect("s"),
        )  # fmt: skip


def test_a_server_killed_with_sigkill_mid_buffer_ends_like_an_uninterrupted_run(tmp_path: Path) -> None:
    """`protofl-server start` (its own Mosquitto, tinyproto, buffer_k=2) killed by SIGKILL right after it journaled
    the stale upload of a half-full buffer (PROTOFL_CRASH_AFTER_APPEND), then started again on the same state dir:
    the devices send their messages again (each upload once its version is out, as a device does), and the run
    ends with the server model of the same messages folded by an aggregator never interrupted (in this process:
    one server start fewer)."""
    from broker_server.service import save_server_model

    ref = Aggregator(_tiny_cfg(), FED, InProcessBroker().connect("server"), policy=ClipPolicy(enabled=False))
    ref.start()
    for _, topic, payload in _tiny_script():
        ref.on_message(topic, payload)
    assert ref.finished and [r.closed_by for r in ref.records] == ["buffer"] * 3
    # appends: 3 joins, a@1, b@1 (version 2), c@1 (stale): the 6th is the stale one, in a half-full buffer
    killed = _run_server(tmp_path / "killed", 6)
    assert np.array_equal(killed, _model_vector(save_server_model(ref.model, tmp_path / "ref.npz")))


def _tiny_cfg() -> Any:
    return make_config(
        "tinyproto", rounds=3, min_clients=3, buffer_k=2, staleness_bound=1, num_classes=3, proto_dim=20,
        adapter_rank=2, seed=3,
    )  # fmt: skip


def _model_vector(path: Path) -> np.ndarray:
    with np.load(path) as z:
        return np.concatenate([z[k].ravel() for k in sorted(z.files) if z[k].dtype.kind == "f"])


def _run_server(state: Path, crash_at: int) -> np.ndarray:
    """The server killed after its `crash_at`-th journal append, then started again until the run ends."""
    from broker_server.ops.broker import free_port
    from protofl.transport.mqtt import MqttTransport

    port = free_port()
    args = ["start", "--local-broker", "mosquitto", "--insecure", "--port", str(port), "--fed", FED]
    args += ["--preset", "tinyproto", "--rounds", "3", "--min-clients", "3", "--set", "buffer_k=2"]
    args += ["--set", "staleness_bound=1", "--set", "num_classes=3", "--set", "proto_dim=20", "--set", "adapter_rank=2"]
    args += ["--seed", "3", "--state-dir", str(state), "--clip", "off", "--verbose"]  # its log says what it got
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    log = state.parent / f"{state.name}.log"
    for start, crash in enumerate((crash_at, None), 1):
        with log.open("a") as out:  # a file, not a pipe nobody reads while the devices run
            server = subprocess.Popen(
                [sys.executable, "-m", "broker_server.cli", *args], stdout=out, stderr=subprocess.STDOUT,
                env=dict(env, PROTOFL_CRASH_AFTER_APPEND=str(crash)) if crash else env,
            )  # fmt: skip
        try:
            # Killed after its crash-th append: only that many of the script's messages go before it (6: 3 joins,
            # a@1, b@1, the stale c@1); what a device sent beyond them would wait in the broker for the server, and a
            # broker restart keeps no order across topics (a@2 redelivered before c@1 would make another version 2).
            _devices(MqttTransport, port, server, log, start, upto=crash)
            try:
                server.wait(timeout=WAIT_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"the server did not finish within {WAIT_S} s; its log:\n{log.read_text()[-4000:]}")
        finally:
            if server.poll() is None:
                server.kill()
        assert server.returncode == (-signal.SIGKILL if crash else 0), log.read_text()[-3000:]
        if crash:  # its Mosquitto stops once it sees its parent gone: a device must not reach the dying one
            _wait_gone(state / "broker" / "mosquitto.pid", log)
    return _model_vector(state / "server_model.npz")


WAIT_S = 120  # for each event the test waits on; a quiet machine takes a few seconds for all of them


def _wait_gone(pid_file: Path, log: Path) -> None:
    """Until the process in `pid_file` has exited (or was reaped)."""
    from broker_server.ops.broker import _is_zombie

    pid = int(pid_file.read_text().strip()) if pid_file.exists() else 0
    end = time.monotonic() + WAIT_S
    while pid and Path(f"/proc/{pid}").exists() and not _is_zombie(pid):
        if time.monotonic() > end:
            pytest.fail(f"the killed server's Mosquitto (pid {pid}) still runs after {WAIT_S} s:\n{log.read_text()}")
        time.sleep(0.05)


def _devices(
    transport: Any, port: int, server: subprocess.Popen[bytes], log: Path, start: int, upto: int | None = None
) -> None:
    """Three devices' messages from one connection, as devices send them: nothing before the server is subscribed
    (its `start`-th "waiting for" line in `log`, logged once its subscriptions are in place: a message published
    before would reach nobody, and a restarted broker's retained config and status are the killed server's), each
    upload once its version is out. Only the first `upto` messages when given. Returns early only when the server
    exited (killed on purpose)."""
    seen = threading.Condition()
    versions = [0]

    def on_round(topic: str, payload: bytes) -> None:
        with seen:
            versions.append(decode_message(payload)[0].round if payload else 0)
            seen.notify_all()

    def wait_for(what: str, ready: Callable[[], bool]) -> bool:
        """Whether `ready` came true (False: the server exited first); fails after WAIT_S."""
        end = time.monotonic() + WAIT_S
        with seen:
            while not ready():
                if server.poll() is not None:
                    return False
                if time.monotonic() > end:
                    pytest.fail(f"no {what} within {WAIT_S} s; the server's log:\n{log.read_text()[-4000:]}")
                seen.wait(0.1)  # woken by a message; the timeout to see the server's log line or its exit
        return True

    if not wait_for("subscribed server", lambda: log.read_text().count("; waiting for ") >= start):
        return
    dev = transport(f"mqtt://127.0.0.1:{port}", "test-devices").connect(WAIT_S)
    dev.subscribe(topics.round_(FED), on_round)
    try:
        for version, topic, payload in _tiny_script()[:upto]:
            if not wait_for(f"version {version}", lambda: max(versions) >= version):  # noqa: B023 - called here
                return
            dev.publish(topic, payload, qos=1)
        # Every message acknowledged by the broker before the connection closes (close() waits 5 s at most: under
        # load the last ones, the run's last upload and the metrics, were lost that way).
        if not dev.flush(WAIT_S) and server.poll() is None:
            pytest.fail(f"the broker did not acknowledge the messages within {WAIT_S} s:\n{log.read_text()[-4000:]}")
    finally:
        dev.close()


def _tiny_script() -> list[tuple[int, str, bytes]]:
    """(the version it waits for, topic, message): joins, tinyproto's CPS-scaled prototypes of mixed versions,
    then each version's participants' metrics."""
    from protofl.plan import RoundPlan
    from protofl.wire import Metrics

    width = RoundPlan.from_config(
        make_config("tinyproto", num_classes=3, proto_dim=20, adapter_rank=2, seed=3)
    ).proto_width
    out = [(0, topics.up(FED, c), encode_message(Join(arch="", n_samples=10), fed=FED, sender=c)) for c in CLIENTS]
    for client, version, value in ((A, 1, 1.0), (B, 1, 3.0), (C, 1, 4.0), (A, 2, 0.0), (B, 2, 5.0),
                                   (C, 3, 1.0)):  # fmt: skip
        protos = ProtoSet(classes=np.arange(3), values=np.full((3, width), value, np.float32), dt="f4")
        msg = ProtoUpload(local=protos, public=None, n_samples=10)
        up = encode_message(msg, fed=FED, sender=client, round=version, phase="train")
        out.append((version, topics.up(FED, client), up))
    for client, version in ((A, 1), (B, 1), (C, 2), (A, 2), (B, 3), (C, 3)):
        metrics = encode_message(Metrics(10, 5, 0, 0), fed=FED, sender=client, round=version, phase="done")
        out.append((3, topics.up(FED, client), metrics))
    return out
