"""Supervision of the broker `protofl-server start` spawned: restarted when it dies, stopped with us.

A thread polls the mosquitto process. When it exits without being asked to, the supervisor logs its exit
status and log tail and starts it again on the same port with the same config (the clients reconnect by
themselves, with backoff). A broker that died by a signal (kill -9, OOM) did not save its persistence
file, so the one on disk is older than its last state (mosquitto saves only on a clean exit or at its
autosave interval): restoring it would bring back stale retained round messages and a stale session for
the server, which would then not re-publish its own. That file is moved aside and the broker starts
empty; the server re-subscribes and re-publishes its retained messages (its session is gone), and devices
resend the uploads of the round announced again (the aggregator drops those it already holds).

A restart that finds the broker's port taken (another process bound it while the broker was down) is
said as such, and retried with backoff until the port is free again. That process is never taken for our
broker: a restart is ready only when our mosquitto owns the port and its unix socket answers (broker.py),
the server's own connection goes through that socket only, and devices with the federation CA refuse a
broker whose certificate it did not sign. Devices without TLS (loopback, `--tls off`) cannot tell.

Dying with the server is the broker's side (broker.py: `die_with_parent`, PR_SET_PDEATHSIG). This thread
is the one that starts every restarted broker, so it lives as long as the server does.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time

from broker_server.ops.broker import BrokerStartError, MosquittoBroker, PortInUse

log = logging.getLogger("protofl.broker")
# A broker that ends so may have got the same signal as its server (Ctrl-C and `kill` of a process group reach
# both): a shutdown, not a death to restart after, once the server's own handler says so (it may run a moment
# later: the supervisor waits for it). Mosquitto exits with status 0 on SIGTERM and SIGINT once its handlers are
# set, and dies of them before; it exits 0 for nothing else.
_SHUTDOWN_EXITS = (0, -15, -2)
_running: list[BrokerSupervisor] = []


def stop_all_supervisors() -> None:
    """The server is stopping (a signal handler calls this): no supervisor of this process restarts its
    broker from now on (thread-safe, never blocks)."""
    for supervisor in list(_running):
        supervisor._stop.set()


def broker_restarts() -> int:
    """Restarts of the brokers this process supervises, so far (thread-safe: a read of ints)."""
    return sum(supervisor.restarts for supervisor in list(_running))


class BrokerSupervisor:
    def __init__(self, broker: MosquittoBroker, *, interval: float = 0.2, max_delay: float = 10.0) -> None:
        self.broker = broker
        self.interval = interval
        self.max_delay = max_delay
        self.restarts = 0
        self.deaths = 0  # the broker's exits seen so far, a shutdown's included (thread-safe: a read of an int)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="broker-supervisor", daemon=True)

    def start(self) -> BrokerSupervisor:
        _running.append(self)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (then stop the broker: the caller's ExitStack does)."""
        self._stop.set()
        self._thread.join(5)
        if self in _running:
            _running.remove(self)

    def _watch(self) -> None:
        delay, reported = 0.5, None
        while not self._stop.wait(self.interval):
            proc = self.broker.proc
            if proc is None or proc.poll() is None:
                continue
            if proc is not reported:  # said once per death, not on every retry
                reported = proc
                self.deaths += 1
                # The same signal may reach us a moment later: give the server's handler time to say so.
                if proc.returncode in _SHUTDOWN_EXITS and self._stop.wait(1.0):
                    return
                self._report_death(proc)
            if self._restart(delay):
                delay = 0.5
                continue
            self.broker.proc = None
            self._stop.wait(delay)
            delay = min(self.max_delay, delay * 2)
            self.broker.proc = proc  # still dead: the next pass tries again

    def _report_death(self, proc: subprocess.Popen[bytes]) -> None:
        rc = proc.returncode
        log.warning(
            "the broker (mosquitto pid %d) died (%s); restarting it on %s. Its log: %s",
            proc.pid,
            f"signal {-rc}" if rc < 0 else f"exit status {rc}",
            self.broker.url,
            self.broker._log_tail(300),
        )
        if rc != 0 and self.broker.db_path.exists():
            aside = self.broker.db_path.with_name(f"mosquitto.db.stale-{int(time.time())}")
            self.broker.db_path.replace(aside)
            log.warning("its persistence file predates the crash; moved aside to %s", aside)

    def _restart(self, delay: float) -> bool:
        try:
            self.broker.start()
        except PortInUse:
            log.error("%s; trying again in %.1f s", self._squatter_warning(), delay)
            return False
        except BrokerStartError as exc:
            log.error("could not restart the broker: %s; trying again in %.1f s", exc, delay)
            return False
        self.restarts += 1
        log.warning("broker restarted (%d restart(s) so far)", self.restarts)
        return True

    def _squatter_warning(self) -> str:
        b = self.broker
        devices = (
            "devices that reconnect refuse it unless its certificate is signed by the broker's CA"
            if b.tls
            else "devices that reconnect (no TLS) may send it their user names and passwords and take "
            "its messages for the server's"
        )
        server = (
            f"this server reaches its broker only through {b.socket_path} and never talks to that process"
            if b.socket_path
            else "this server's own reconnects go to that port too"
        )
        return (
            f"could not restart the broker: another process took its port {b.port} on {b.host} while it was "
            f"down; {devices}; {server}. Stop that process (ss -ltnp 'sport = :{b.port}' names it)"
        )
