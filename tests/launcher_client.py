"""`python -S tests/launcher_client.py MODULE ARGS...`: run `python -m MODULE ARGS...` through the test launcher
(tests/launcher.py) named by $PROTOFL_TEST_LAUNCHER, for commands a shell starts (the doc pages' shims).

This process stands in for the command: it hands the launcher its standard streams, environment and working
directory, passes on the signals it gets, and exits as the command did (with its status, or killed by its
signal). If this process is killed, the launcher kills the command. Where the launcher refuses (an environment it
cannot reproduce) or is gone, it runs the command the ordinary way (exec). Standard library only: it starts
without site-packages (-S), in milliseconds.
"""

import json
import os
import signal
import socket
import struct
import sys
from collections.abc import Iterator

SOCKET = "PROTOFL_TEST_LAUNCHER"


def send_request(conn: socket.socket, request: dict[str, object], fds: list[int]) -> None:
    """The one request form (tests/launcher.py reads it): its JSON's length, the JSON, and the command's
    stdin, stdout and stderr passed along (SCM_RIGHTS)."""
    payload = json.dumps(request).encode()
    socket.send_fds(conn, [struct.pack("!I", len(payload)) + payload], fds)


def _ordinary(module: str, args: list[str]) -> None:
    os.environ.pop(SOCKET, None)
    os.execv(sys.executable, [sys.executable, "-m", module, *args])


def _lines(conn: socket.socket) -> Iterator[dict[str, object]]:
    buf = b""
    while True:
        while b"\n" in buf:
            line, _, buf = buf.partition(b"\n")
            yield json.loads(line)
        chunk = conn.recv(4096)
        if not chunk:
            return
        buf += chunk


def main() -> None:
    module, args = sys.argv[1], sys.argv[2:]
    path = os.environ.get(SOCKET, "")
    if not path:
        _ordinary(module, args)
    env = {k: v for k, v in os.environ.items() if k != SOCKET}
    request = {"module": module, "argv": args, "env": env, "cwd": os.getcwd(), "kill_on_eof": True}
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        send_request(conn, request, [0, 1, 2])
        replies = _lines(conn)
        first = next(replies, None)
    except OSError:
        first = None
    if first is None or "pid" not in first:
        conn.close()
        _ordinary(module, args)
        return
    pid = int(str(first["pid"]))

    def forward(signum: int, _frame: object) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, forward)
    last = next(replies, None)
    if last is None:
        sys.exit(255)  # the launcher went away without the status
    status = int(str(last["status"]))
    if os.WIFSIGNALED(status):
        killed_by = os.WTERMSIG(status)
        signal.signal(killed_by, signal.SIG_DFL)
        os.kill(os.getpid(), killed_by)
    sys.exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main()
