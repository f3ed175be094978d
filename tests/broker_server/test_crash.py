"""Crash safety end to end: real Mosquitto, a real `protofl-server start` process killed with SIGKILL,
real `protofl-edge join` processes; the 6-kill test runs the default a user runs (the server's own
secured Mosquitto, generated credentials, the default offline grace).

What is asserted, and why "to float tolerance" and not bytes: the killed-and-restarted federation ends
with the uninterrupted one's global adapter and prototypes within rtol 1e-5 / atol 1e-6. Each device
trains deterministically (seeded by federation seed, client and round, one torch thread) from the round
message, and a restart republishes the same round message, so every round sees the same uploads; but
uploads reach the aggregator in whatever order the broker delivers them, in both runs, and the
streaming means fold them in that order, so the float sums may differ in their last bits. (In the same
order the restart is bit-exact: test_durability.py cuts an in-process run after every message.) The
journal must hold every device's every upload exactly once: none applied twice, none lost.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from broker_server.core.durable import journal_records
from broker_server.ops.broker import MosquittoBroker
from tests.broker_server.crash_helpers import Federation

CLIENTS, ROUNDS = 4, 10
# Where each of the 6 kills happens: SIGKILL at a random moment once the server made progress (mid-phase,
# mid-replay, while devices resend), or the server kills itself at an injected point (broker_server/core/journal.py):
# right after a journal append, right after a checkpoint, in the middle of an append (a torn record).
MOMENTS = ["random", "after_append", "random", "after_checkpoint", "mid_append", "random"]
LONG_DOWNTIMES = {3: 8.0}  # the server (and its broker) stay down this long; else 0-2 s
CRASH_ENV = {
    "after_append": "PROTOFL_CRASH_AFTER_APPEND",
    "after_checkpoint": "PROTOFL_CRASH_AFTER_CHECKPOINT",
    "mid_append": "PROTOFL_CRASH_MID_APPEND",
}
UPLOAD_KINDS = ("adapter", "protos")


def uninterrupted(name: str, clients: int, rounds: int, base: Path, url: str) -> dict[str, np.ndarray]:
    fed = Federation(name, clients, rounds, base / "state", base / "logs", broker_url=url)
    fed.start_server()
    fed.start_agents()
    try:
        fed.wait_finished(240)
    finally:
        fed.stop()
    return fed.model()


SMALL_CLIENTS, SMALL_ROUNDS = 3, 15


@pytest.fixture(scope="module")
def small_reference(
    tmp_path_factory: pytest.TempPathFactory, mosquitto_module: MosquittoBroker
) -> dict[str, np.ndarray]:
    """A 3-device federation, never interrupted (the broker and device tests' reference)."""
    return uninterrupted(
        "small", SMALL_CLIENTS, SMALL_ROUNDS, tmp_path_factory.mktemp("small-reference"), mosquitto_module.url
    )


def journal_size(fed: Federation) -> int:
    return sum(p.stat().st_size for p in (fed.state / "aggregator").glob("journal-*.log"))


def wait_for(pred: Callable[..., object], timeout: float, what: str, fed: Federation) -> None:
    """Poll `pred()` until it holds (a predicate may bind a loop's values as its defaults)."""
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}; server log:\n{fed.log_tail()}")
        time.sleep(0.02)


def assert_same_model(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


def audit_journal(fed: Federation, clients: int, rounds: int) -> None:
    """Every device's adapter and prototypes of every round exactly once, one join per device, and every
    round closed once with every device in it."""
    recs = journal_records(fed.state / "aggregator")
    uploads = [(r.client, r.round, r.phase, r.kind) for r in recs if r.kind in UPLOAD_KINDS]
    assert len(uploads) == len(set(uploads)), "an upload was applied twice"
    ids = [fed.client_id(i) for i in range(clients)]
    want = {(c, r, "train", k) for c in ids for r in range(1, rounds + 1) for k in UPLOAD_KINDS}
    assert set(uploads) == want, f"missing {sorted(want - set(uploads))[:5]}, extra {sorted(set(uploads) - want)[:5]}"
    # every device joined; a join again from a device in its grace (back after a restart) ends that grace: journaled
    assert sorted({r.client for r in recs if r.kind == "join"}) == sorted(ids)
    rows = [json.loads(line) for line in (fed.state / "rounds.jsonl").read_text().splitlines()]
    assert [row["round"] for row in rows] == list(range(1, rounds + 1))  # each round once
    assert all(row["clients"] == sorted(ids) for row in rows), [row["clients"] for row in rows]


def _kill_at(moment: str, fed: Federation, rng: random.Random) -> None:
    """End the running server at `moment`: it was started to kill itself there, or SIGKILL it now."""
    server = fed.server
    assert server is not None
    if moment in CRASH_ENV:
        wait_for(lambda: server.poll() is not None, 120, f"the {moment} crash", fed)
        assert server.returncode in (-9, 0), f"the server ended with {server.returncode}:\n{fed.log_tail()}"
        return
    size = journal_size(fed)
    wait_for(lambda: journal_size(fed) > size or server.poll() is not None, 120, "progress", fed)
    time.sleep(rng.uniform(0.0, 0.4))
    fed.kill_server()


@pytest.mark.slow
@pytest.mark.mosquitto
def test_the_default_start_killed_6_times_ends_like_an_uninterrupted_run(tmp_path: Path) -> None:
    """The default a user runs: `protofl-server start` with its own secured Mosquitto (dying with the
    server: it publishes every device's will and saves it), generated credentials, live `join` processes
    with their devices/<id>.json, the default offline grace. Killed 6 times with downtimes up to 8 s,
    it ends with the uninterrupted run's model, every round once with every device, every upload once."""
    from broker_server.ops.broker import free_port

    rng = random.Random(24)
    # The reference, never interrupted, runs alongside (same settings, own state dir and broker), so that
    # its CPU time overlaps the crash run's downtimes.
    ref = Federation(
        "crash",
        CLIENTS,
        ROUNDS,
        tmp_path / "ref" / "state",
        tmp_path / "ref" / "logs",
        port=free_port(),
        secured=True,
        offline_grace=None,
    )
    fed = Federation(
        "crash",
        CLIENTS,
        ROUNDS,
        tmp_path / "state",
        tmp_path / "logs",
        port=free_port(),
        secured=True,
        offline_grace=None,
    )
    for f in (ref, fed):
        f.start_server()
        # the devices' credentials exist once the server has written them
        wait_for(lambda f=f: (f.state / "security" / "devices" / "device-1.json").exists(), 60, "credentials", f)
        f.start_agents()
    kills = torn = 0
    try:
        for k, moment in enumerate(MOMENTS):
            _kill_at(moment, fed, rng)
            if fed.server is not None and fed.server.returncode == 0:
                break  # finished before this crash point was reached
            kills += 1
            torn += moment == "mid_append"
            time.sleep(LONG_DOWNTIMES.get(k, rng.uniform(0.0, 2.0)))  # the downtime itself
            nxt = MOMENTS[k + 1] if k + 1 < len(MOMENTS) else "none"
            fed.start_server(**({CRASH_ENV[nxt]: str(rng.randint(1, 4))} if nxt in CRASH_ENV else {}))
        fed.wait_finished(300)
        ref.wait_finished(300)
    finally:
        fed.stop()
        ref.stop()
    log = (fed.logs / "server.log").read_text()
    assert kills >= 5, f"only {kills} kills before the federation finished"
    assert log.count("resumed federation 'crash'") >= kills  # every restart resumed
    assert log.count("a torn last record") == torn
    audit_journal(ref, CLIENTS, ROUNDS)
    audit_journal(fed, CLIENTS, ROUNDS)
    assert_same_model(fed.model(), ref.model())


def rounds_closed(fed: Federation) -> int:
    """The last round the server says it closed ("round N: k/n clients"), as it closes: rounds.jsonl's line waits
    for the round's metrics, which may come after the whole federation has run (rounds of 0.1-0.2 s)."""
    found = re.findall(r"\bround (\d+): \d+/\d+ clients", fed.log_tail(10**7))
    return max(map(int, found), default=0)


def broker_pid(fed: Federation) -> int:
    """mosquitto's pid from its pid file (0 while it is being written)."""
    try:
        return int((fed.state / "broker" / "mosquitto.pid").read_text().strip())
    except (OSError, ValueError):
        return 0


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.slow
@pytest.mark.mosquitto
def test_the_spawned_broker_is_supervised_and_dies_with_the_server(
    small_reference: dict[str, np.ndarray], tmp_path: Path
) -> None:
    # The server's own mosquitto (persistence under --state-dir/broker): kill -9 of the broker mid-run,
    # twice (the server restarts it; server and devices reconnect), then kill -9 of the server (its
    # broker exits with it, no orphan; the restarted server starts a new one and resumes). The result
    # equals an uninterrupted run of the same federation (allclose, as above).
    from broker_server.ops.broker import free_port

    fed = Federation("bk", SMALL_CLIENTS, SMALL_ROUNDS, tmp_path / "state", tmp_path / "logs", port=free_port())
    try:
        fed.start_server()
        fed.start_agents()
        rng = random.Random(3)
        for n, at in enumerate((0, 3), 1):  # during the joins (a lost join), then mid-round
            # ... and the broker's pid file written: os.kill(0, ...) would kill this test's whole process group
            # (pytest with it), which a fast start reached once the test launcher dropped the import time.
            wait_for(
                lambda at=at: journal_size(fed) > 0 and rounds_closed(fed) >= at and alive(broker_pid(fed)),
                120,
                f"{at} rounds",
                fed,
            )
            time.sleep(rng.uniform(0.0, 0.3))
            pid = broker_pid(fed)
            assert pid > 0, f"the federation ended before the broker could be killed mid-run:\n{fed.log_tail()}"
            os.kill(pid, signal.SIGKILL)
            # The restart is done when the server says so: a new pid alone may still be starting (on a
            # loaded machine a kill then lands inside the supervisor's readiness check, a third death).
            wait_for(
                lambda pid=pid, n=n: (
                    broker_pid(fed) != pid
                    and alive(broker_pid(fed))
                    and fed.log_tail(10**7).count("broker restarted") >= n
                ),
                30,
                "the broker's restart",
                fed,
            )
        wait_for(lambda: rounds_closed(fed) >= 7, 120, "7 rounds", fed)
        pid = broker_pid(fed)
        fed.kill_server()
        wait_for(lambda: not alive(pid), 10, "the broker to exit with its server", fed)
        fed.start_server()
        fed.wait_finished(240)
    finally:
        fed.stop()
    log = (fed.logs / "server.log").read_text()
    assert log.count("broker restarted") == 2 and "resumed federation 'bk'" in log, fed.log_tail()
    assert not alive(broker_pid(fed))  # stopped with the server at the end
    audit_small(fed)
    assert_same_model(fed.model(), small_reference)


@pytest.mark.slow
@pytest.mark.mosquitto
def test_a_device_killed_mid_round_resumes_from_its_own_checkpoint(
    small_reference: dict[str, np.ndarray], mosquitto_module: MosquittoBroker, tmp_path: Path
) -> None:
    # dev-01 (with --state-dir) is killed with SIGKILL twice at random moments and restarted: it loads its
    # own last local state (backbone weights included, trained over the rounds it took part in) and
    # resumes from the retained round message. Without that, its restarted backbone would be the seeded
    # initial one and the federation's result would differ from the uninterrupted run's.
    # A round here takes ~0.1 s once every device is up, so the whole federation can end inside the random
    # delay before a kill. The other two devices are therefore frozen (SIGSTOP) around each kill: no round can
    # close without them, so dev-01 always dies mid-federation, training its round or waiting for the next.
    rng = random.Random(7)
    fed = Federation(
        "devkill",
        SMALL_CLIENTS,
        SMALL_ROUNDS,
        tmp_path / "state",
        tmp_path / "logs",
        broker_url=mosquitto_module.url,
        device_state=tmp_path / "devices",
    )
    ckpt = tmp_path / "devices" / "devkill-dev-01.ckpt"
    dev_log_path = fed.logs / "dev-01.log"
    try:
        fed.start_server()
        fed.start_agents()
        for k in range(2):
            # first life: once it has checkpointed a round; second: once it has resumed from that checkpoint
            wait_for(
                lambda k=k: ckpt.exists() and dev_log_path.read_text().count("dev-01: resumed from") == k,
                120,
                f"dev-01's life {k + 1} to be under way",
                fed,
            )
            others = [fed.agents[i] for i in range(SMALL_CLIENTS) if i != 1]
            for p in others:
                p.send_signal(signal.SIGSTOP)
            try:
                time.sleep(rng.uniform(0.0, 0.3))
                fed.agents[1].send_signal(signal.SIGKILL)
                fed.agents[1].wait()
                fed.agents[1] = fed.start_agent(1)
            finally:
                for p in others:
                    p.send_signal(signal.SIGCONT)
        fed.wait_finished(240)
    finally:
        fed.stop()
    dev_log = dev_log_path.read_text()
    assert dev_log.count("dev-01: resumed from") == 2, dev_log[-3000:]
    audit_small(fed)
    assert_same_model(fed.model(), small_reference)


def audit_small(fed: Federation) -> None:
    audit_journal(fed, SMALL_CLIENTS, SMALL_ROUNDS)
