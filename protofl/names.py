"""Names that several commands and both sides check: one definition each.

Client and federation ids travel in topics and envelopes, so they are restricted to characters that
are safe in an MQTT topic level and in a file name. Extractor names select what computes z on a
device (torch, or onnxruntime on an exported backbone). Class names (a federation's `class_names`, a device's
class folders) are matched by `class_key`.
"""

from __future__ import annotations

import re

from protofl.errors import ConfigError

NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")
NAME_RULE = "1-64 characters from A-Z a-z 0-9 _ . -"

EXTRACTORS = ("torch", "onnx")

# What a member may say in one text field (Status.detail, Join's arch/profile/agent_version): longer is refused
# at decoding (protofl/wire/messages.py), so no string a member controls reaches the server's log unbounded.
MAX_TEXT = 1024
MAX_LABEL = 128  # a short field: an architecture, a profile, a version, a metrics key
# What a log line shows of such a string (`printable`).
LOG_TEXT = 300
# C0/C1 controls (newlines included: a forged log line), line and paragraph separators, bidi overrides.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def class_key(name: str) -> str:
    """What a class name is matched by: case, spaces and punctuation ignored ("Ankle boot" = "ankle-boot",
    "T-shirt/top" = "t_shirt_top"), so that a folder name, which cannot hold '/', can name any class."""
    return re.sub(r"[^0-9a-z]+", "-", name.casefold()).strip("-")


def is_valid_name(name: str) -> bool:
    """A client id, federation name or sender: `NAME_RULE`."""
    return bool(NAME_PATTERN.fullmatch(name))


def check_name(name: str, what: str) -> str:
    if not is_valid_name(name):
        raise ConfigError(f"{what} '{name}' is not a valid name ({NAME_RULE})")
    return name


def printable(text: str, limit: int = LOG_TEXT) -> str:
    """`text` (a string a member sent) as one log line may show it: control characters as '?' (no forged
    line, no terminal escape), at most `limit` characters (then "...", and how long it was)."""
    shown = _UNPRINTABLE.sub("?", text[:limit])
    return shown if len(text) <= limit else f"{shown}... ({len(text)} characters)"


def check_extractor(name: str) -> str:
    if name not in EXTRACTORS:
        raise ConfigError(f"extractor must be one of {', '.join(EXTRACTORS)}, got {name!r}")
    return name
