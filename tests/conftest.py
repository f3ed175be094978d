"""Shared fixtures: a real Mosquitto on a free port, started and stopped by the tests.

CI installs mosquitto (README: apt-get install mosquitto), so a missing binary is a failure, not a
silent skip; set PROTOFL_ALLOW_NO_MOSQUITTO=1 to skip those tests on a machine without it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Iterator
from pathlib import Path

# Before torch starts its OpenMP threads, here and in every process a test spawns: idle threads sleep instead of
# spinning. Tests run several torch processes at once on CI's 2 cores (devices, servers); spinning threads took
# each other's CPU (a small simulation beside two others: 8.3 s of user time, 3.9 s passive; the same report).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
from pluggy import Result  # noqa: E402

from broker_server.ops.broker import MosquittoBroker, find_mosquitto
from tests import launcher

# The project's commands that tests start are forked from a preloaded process (tests/launcher.py says what stays
# real and when a command is started the ordinary way): the suite is CPU-bound, and each fresh interpreter spent
# its first seconds importing torch.
launcher.install()

ALLOW_MISSING = "PROTOFL_ALLOW_NO_MOSQUITTO"

# How long a test waits for an event it expects (a process's exit, a message, a line): a bound that no load reaches
# (CI's 2 shared cores running several torch processes, a parallel run), so a test fails on it only where the event
# never comes, and waits only as long as the event takes. PROTOFL_TEST_WAIT_SCALE multiplies it (a slower machine);
# it stays well under pytest's per-test timeout (pyproject.toml, 900 s).
WAIT_SCALE = float(os.environ.get("PROTOFL_TEST_WAIT_SCALE", "1"))
EVENT_WAIT_S = 300.0 * WAIT_SCALE


def _require_mosquitto() -> str:
    path = find_mosquitto()
    if path is None:
        msg = (
            "mosquitto is not installed (looked on PATH and in /usr/sbin, /usr/local/sbin): "
            "install it with `apt-get install mosquitto`"
        )
        if os.environ.get(ALLOW_MISSING) == "1":
            pytest.skip(f"{msg} ({ALLOW_MISSING}=1)")
        pytest.fail(f"{msg}, or set {ALLOW_MISSING}=1 to skip the broker tests", pytrace=False)
    return path


@pytest.fixture
def start_mosquitto(tmp_path: Path) -> Iterator[Callable[..., MosquittoBroker]]:
    """Factory: `start_mosquitto(max_packet_size=..., persistence=...)` -> a running broker on a free port,
    stopped after the test. Each broker gets its own work directory (config, log, persistence file)."""
    binary = _require_mosquitto()
    started: list[MosquittoBroker] = []

    def start(**kwargs: object) -> MosquittoBroker:
        workdir = tmp_path / f"mosquitto-{len(started)}"
        broker = MosquittoBroker(workdir=workdir, binary=binary, **kwargs)  # type: ignore[arg-type]
        started.append(broker)
        return broker.start()

    yield start
    for broker in started:
        broker.stop()


@pytest.fixture
def mosquitto(start_mosquitto: Callable[..., MosquittoBroker]) -> MosquittoBroker:
    """A running mosquitto (MQTT 5, persistence off) for one test."""
    return start_mosquitto(persistence=False)


@pytest.fixture(scope="module")
def mosquitto_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MosquittoBroker]:
    """One mosquitto shared by a module's tests (federations use distinct federation names)."""
    binary = _require_mosquitto()
    broker = MosquittoBroker(workdir=tmp_path_factory.mktemp("mosquitto"), binary=binary, persistence=False)
    broker.start()
    yield broker
    broker.stop()


def pytest_configure(config: pytest.Config) -> None:
    """The project's modules compiled to bytecode once, before the tests start (in the controller, not in each
    xdist worker). The tests start some hundreds of Python processes (servers, devices, doc pages); where
    PYTHONDONTWRITEBYTECODE is set (this project's CI image sets it) each of them compiled every module it imports
    from source again: 0.4 s of CPU for `protofl-server`'s imports alone, 1.0 s instead of 1.4 s with the cache.
    compileall writes the caches whatever that variable says; imports read them (timestamps checked as usual)."""
    if hasattr(config, "workerinput"):
        return
    import compileall

    root = Path(__file__).resolve().parents[1]
    for package in ("protofl", "edge_agent", "broker_server", "export", "bench", "tests"):
        compileall.compile_dir(root / package, quiet=2)


ALLOW_NO_DATA = "PROTOFL_ALLOW_NO_DATA"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Result[pytest.TestReport], None]:
    """A test skipped because Fashion-MNIST is missing counts as failed: CI installs the data
    (README: apt-get install dataset-fashion-mnist), and a skipped test checks nothing. Set
    PROTOFL_ALLOW_NO_DATA=1 to allow those skips on a machine without the package."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and "Fashion-MNIST" in str(report.longrepr) and os.environ.get(ALLOW_NO_DATA) != "1":
        report.outcome = "failed"
        report.longrepr = (
            f"Fashion-MNIST is not installed ({report.longrepr}); apt-get install "
            f"dataset-fashion-mnist, or set {ALLOW_NO_DATA}=1 to skip the tests that need it"
        )


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """torch single-threaded for a module, restored afterwards.

    Small batches run fastest on one thread, and on a shared 2-core box intra-op threads that spin
    while another process (an agent, onnxruntime) holds the other core made single forwards 30x slower.
    """
    import torch  # here, not at collection: the numpy-only tests must not need it

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
