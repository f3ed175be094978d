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


def check_extractor(name: str) -> str:
    if name not in EXTRACTORS:
        raise ConfigError(f"extractor must be one of {', '.join(EXTRACTORS)}, got {name!r}")
    return name
