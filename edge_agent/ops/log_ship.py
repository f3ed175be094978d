"""A device's log lines to the server (issue 45): `protofl-edge join --ship-logs LEVEL` sends each line of the
`protofl` loggers at LEVEL or above on the device's own `log/<id>` topic (a Status message: the level and the
line, cut to the wire's text limit), at most `LINES_PER_MINUTE` a minute; the lines over that are counted and said
in one line when the next minute starts. QoS 0 and never retained: a line lost on a bad link is not sent again.
The server bounds them again (broker_server/ops/device_logs.py)."""

from __future__ import annotations

import logging
import threading
import time

from protofl import topics
from protofl.names import MAX_TEXT
from protofl.transport.mqtt import MqttTransport
from protofl.wire import Status, encode_message

LINES_PER_MINUTE = 60
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class LogShipper(logging.Handler):
    def __init__(self, transport: MqttTransport, fed: str, client_id: str, level: int) -> None:
        super().__init__(level)
        self.transport, self.fed, self.client_id = transport, fed, client_id
        self.topic = topics.device_log(fed, client_id)
        self._window, self._sent, self.left_out = time.monotonic(), 0, 0
        self._busy = threading.local()  # a line the transport logs while this handler publishes is not shipped

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(self._busy, "on", False) or not self.transport.connected:
            return
        now = time.monotonic()
        lines = []
        if now - self._window >= 60:
            if self.left_out:
                lines.append(("warning", f"{self.left_out} log line(s) not shipped (at most {LINES_PER_MINUTE}/min)"))
            self._window, self._sent, self.left_out = now, 0, 0
        if self._sent >= LINES_PER_MINUTE:
            self.left_out += 1
            return
        self._sent += 1
        lines.append((record.levelname.lower(), f"{record.name}: {record.getMessage()}"))
        self._busy.on = True
        try:
            for level, text in lines:
                detail = text if len(text) <= MAX_TEXT else text[: MAX_TEXT - 3] + "..."
                payload = encode_message(Status(state=level, detail=detail), fed=self.fed, sender=self.client_id)
                self.transport.publish(self.topic, payload, qos=0)
        except Exception:  # noqa: BLE001 - a log line never stops the device
            pass
        finally:
            self._busy.on = False
