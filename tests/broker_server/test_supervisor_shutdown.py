"""The spawned broker's supervisor (broker_server/ops/supervisor.py) and a stop signal that reaches the broker first:
Mosquitto exits 0 on SIGTERM; a server whose own handler runs a moment later must not have restarted it meanwhile
(on main a clean exit was restarted at once: `kill` of the process group logged "broker restarted" about one run in
twelve under load). A broker stopped alone, with no stop of the server, is still restarted."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from broker_server.ops.broker import MosquittoBroker
from broker_server.ops.supervisor import BrokerSupervisor, stop_all_supervisors
from tests.broker_server.fleet_helpers import wait_for
from tests.conftest import EVENT_WAIT_S


@pytest.mark.mosquitto
def test_a_broker_stopped_by_the_servers_signal_is_not_restarted_and_one_stopped_alone_is(tmp_path: Path) -> None:
    broker = MosquittoBroker(workdir=tmp_path / "broker").start()
    supervisor = BrokerSupervisor(broker, interval=0.01).start()
    try:
        first = broker.proc
        assert first is not None
        os.kill(first.pid, signal.SIGTERM)  # the signal reaches the broker; the server's handler has not run yet
        assert first.wait(EVENT_WAIT_S) == 0  # Mosquitto's clean exit
        wait_for(lambda: supervisor.deaths == 1, EVENT_WAIT_S, "the supervisor to see the broker's exit")
        stop_all_supervisors()  # the server's handler, late
        supervisor.stop()
        assert supervisor.restarts == 0 and broker.proc is first, supervisor.restarts

        broker.start()  # a new server's broker; this time the broker alone is stopped
        again = BrokerSupervisor(broker, interval=0.01).start()
        try:
            second = broker.proc
            assert second is not None
            os.kill(second.pid, signal.SIGTERM)
            wait_for(lambda: again.restarts == 1, EVENT_WAIT_S, "the broker stopped alone to be restarted")
            assert broker.proc is not second and broker.proc is not None and broker.proc.poll() is None
        finally:
            again.stop()
    finally:
        broker.stop()
