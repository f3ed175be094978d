"""The server's log lines about what one member sent, rate-limited per member (issue 43).

A member decides how often the server logs about it (a presence each millisecond, a refused message each
millisecond), so each member gets at most `LINES_PER_MINUTE` lines a minute; the lines over that are
counted, and the first line about that member in a later minute is preceded by how many were left out.
Whatever a member wrote in a line goes through `protofl.names.printable` first (bounded, no control
characters: no forged line).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

LINES_PER_MINUTE = 30
WINDOW_S = 60.0
_MAX_MEMBERS = 100_000  # members tracked at once: more than a fleet; expired windows go first


class MemberLog:
    """`log(level, member, fmt, *args)`: `logger.log` at most `lines` times per member per `window` seconds."""

    def __init__(
        self,
        logger: logging.Logger,
        lines: int = LINES_PER_MINUTE,
        window: float = WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger, self.lines, self.window, self.clock = logger, lines, window, clock
        self._windows: dict[str, list[float]] = {}  # member -> [window start, lines logged, lines left out]
        self.left_out = 0  # lines left out so far, all members

    def __call__(self, level: int, member: str, fmt: str, *args: object) -> bool:
        """Log the line unless `member` had its lines this window; True if it was logged."""
        if not self.logger.isEnabledFor(level):
            return False
        now = self.clock()
        w = self._windows.get(member)
        if w is None or now - w[0] >= self.window:
            if w is None and len(self._windows) >= _MAX_MEMBERS:
                self._prune(now)
            if w is not None and w[2]:
                self.logger.warning(
                    "%d more log line(s) about %s in %.0f s were left out (at most %d per member per minute)",
                    int(w[2]),
                    member,
                    now - w[0],
                    self.lines,
                )
            w = self._windows[member] = [now, 0, 0]
        if w[1] >= self.lines:
            w[2] += 1
            self.left_out += 1
            return False
        w[1] += 1
        self.logger.log(level, fmt, *args)
        return True

    def _prune(self, now: float) -> None:
        self._windows = {m: w for m, w in self._windows.items() if now - w[0] < self.window}
        if len(self._windows) >= _MAX_MEMBERS:
            self._windows.clear()
