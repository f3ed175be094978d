"""What a signal handler may log, and how.

A Python signal handler runs in the main thread between two of its steps, and that step may be a write to the same
stream the handler's log line goes to (the server logs a line and a SIGTERM lands while it is being written). A
buffered stream then refuses the second write with "RuntimeError: reentrant call", and that error, raised inside
the handler, lost the stop: `protofl-server start` sent SIGTERM just after it logged "waiting for N client(s)" kept
serving (found by the test of SIGTERM to the process group, under the faster start of the test launcher; Python
without PYTHONUNBUFFERED, i.e. every service unit). So handlers do their stopping themselves and hand their line
to a short thread, which writes it as soon as the interrupted write is done; it is not a daemon, so the line is
written before the process exits.
"""

from __future__ import annotations

import logging
import threading


def log_from_handler(logger: logging.Logger, level: int, msg: str, *args: object) -> None:
    """Log `msg % args` from a signal handler without writing from the handler itself."""
    threading.Thread(target=logger.log, args=(level, msg, *args), name="signal-log").start()
