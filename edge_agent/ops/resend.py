"""A device's side of the server's re-send requests (broker_server/ops/resend.py): read, checked, rate-limited.

The broker may drop a device's upload or join after acknowledging it (its queue for the aggregator was
full); the server then asks the device, on the device's own `down/<id>` topic, to send it again. Only
the server may write that topic (the generated ACL); a request is still read as hostile input: its size
is bounded before it is parsed (the wire's small-kind limit), it must be a `resend` of this federation
from the server, and one kind of request for one round and phase is honoured at most once every
`MIN_INTERVAL_S`, so that nothing can make the device flood the broker. numpy-free, no torch: a
lightweight load generator can use it as the runner does.
"""

from __future__ import annotations

import dataclasses
import logging

from protofl.errors import WireError
from protofl.topics import SERVER_ID
from protofl.wire import Envelope, Limits, Pace, Resend, Status, decode_message, read_header
from protofl.wire.codec import SECAGG_SERVER_KINDS

log = logging.getLogger("protofl.edge")
MIN_INTERVAL_S = 1.0
REQUEST_LIMITS = Limits(
    max_message_bytes=4096,
    max_elements=16,
    max_list_len=16,
    max_map_len=16,
    max_str_len=256,
    max_bin_len=16,
    max_objects=64,
)

# What the server says on `down/<id>` when it refuses this device's join for good (broker_server/core/shell.py REFUSED).
REFUSED = "refused"
REFUSAL_LIMITS = dataclasses.replace(REQUEST_LIMITS, max_str_len=2048)  # the reason is a sentence or two


def refusal(payload: bytes, fed: str) -> str | None:
    """Why the server refused this device's join, if `payload` (on its `down/` topic) is the server's refusal."""
    try:
        env, msg = decode_message(payload, limits=REFUSAL_LIMITS)
    except WireError:
        return None
    if isinstance(msg, Status) and msg.state == REFUSED and env.sender == SERVER_ID and env.fed == fed:
        return msg.detail or "refused by the server"
    return None


def pace(payload: bytes, fed: str) -> tuple[int, Pace] | None:
    """(round, the message) if `payload` (on our `down/` topic) is the server's pace steering: we are not in that
    round, and it expects us back at `until` (broker_server/core/selection.py)."""
    try:
        env, msg = decode_message(payload, limits=REFUSAL_LIMITS)
    except WireError:
        return None
    if isinstance(msg, Pace) and env.sender == SERVER_ID and env.fed == fed:
        return env.round, msg
    return None


def secagg_step(payload: bytes, fed: str) -> bool:
    """Whether `payload` (on our `down/` topic) is a step of a secure aggregation (protofl/secagg.py): the agent
    reads it whole, with its own limits (a roster names up to MAX_NEIGHBOURS keys)."""
    try:
        head = read_header(payload)  # the envelope only: the agent reads the body with the federation's limits
    except WireError:
        return False
    return head.kind in SECAGG_SERVER_KINDS and head.sender == SERVER_ID and head.fed == fed


class ResendRequests:
    """Turns what arrives on `down/<id>` into requests to honour: (envelope, Resend) or None."""

    def __init__(self, fed: str, client_id: str, min_interval: float = MIN_INTERVAL_S) -> None:
        self.fed = fed
        self.client_id = client_id
        self.min_interval = min_interval
        self.honoured = 0
        self.refused = 0
        self._last: dict[tuple[str, int, str], float] = {}

    def read(self, payload: bytes, now: float) -> tuple[Envelope, Resend] | None:
        try:
            env, msg = decode_message(payload, limits=REQUEST_LIMITS)
        except WireError as exc:
            self._refuse(f"unreadable ({exc})")
            return None
        if not isinstance(msg, Resend) or env.sender != SERVER_ID or env.fed != self.fed:
            self._refuse(f"a {env.kind} from '{env.sender}' of federation '{env.fed}', not the server's request")
            return None
        key = (msg.ask, env.round, env.phase)
        if now - self._last.get(key, float("-inf")) < self.min_interval:
            return None  # asked again within the interval: once is enough
        if len(self._last) > 64:  # only recent keys matter
            self._last = {k: t for k, t in self._last.items() if now - t < self.min_interval}
        self._last[key] = now
        self.honoured += 1
        return env, msg

    def _refuse(self, why: str) -> None:
        self.refused += 1
        log.warning("%s: ignored a message on its request topic: %s", self.client_id, why)
