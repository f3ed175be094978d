"""What the `protofl-server` commands parse (`simulate` and `start`) and print (`simulate`, `status`) the same way."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from rich.console import Console, RenderableType

from protofl import cli_options
from protofl.config import load_config_file
from protofl.errors import ConfigError

# What a dataset decides unless the user fixes it (class names, from --classes or a config, fix num_classes too).
DATA_KEYS = ("num_classes", "in_shape", "class_names")
CLIP_VALUES = ("on", "off")
CLIP_HELP = (
    "Clip every upload to a ball around the current global value (radius: 10x the previous round's "
    "median upload norm), a defence against a poisoning member that no paper's method has; off folds "
    "uploads as they were sent."
)

# On by default in both commands: a simulation runs the aggregator a deployment runs (the benchmark's
# papers' rows pass --clip off).
CLIP_OPTION = typer.Option(
    "on", "--clip", metavar="on|off", help=CLIP_HELP, rich_help_panel=cli_options.FEDERATION_PANEL
)


def parse_clip(value: str) -> bool:
    """`--clip on|off` as a bool; anything else is a ConfigError that names the option and its values."""
    text = value.strip().lower()
    if text not in CLIP_VALUES:
        raise ConfigError(f"--clip must be on or off, got '{value}'")
    return text == "on"


def parse_sets(items: list[str]) -> dict[str, Any]:
    """`--set key=value` overrides: the value as JSON (numbers, true, lists), a comma-separated list of numbers
    as a list (`in_shape=3,32,32`), else a bare string (`mu=auto`, `archs=cnn,mlp`)."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got '{item}'")
        key, raw = item.split("=", 1)
        out[key.strip()] = _value(raw)
    return out


def _value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        pass
    if "," in raw:
        try:
            parts = [json.loads(p) for p in raw.split(",")]
        except json.JSONDecodeError:
            return raw
        if all(isinstance(p, (int, float)) and not isinstance(p, bool) for p in parts):
            return parts
    return raw  # a bare string such as mu=auto


def fixed_by_user(config_file: str | None, overrides: dict[str, Any]) -> set[str]:
    """The data keys (`num_classes`, `in_shape`) that `--config` or `--set` fix: the data must then fit them
    (an image folder is resized, a CSV reshaped) instead of deciding them."""
    named = {k for k, v in overrides.items() if v is not None}
    if config_file:
        named |= set(load_config_file(config_file))
    if "class_names" in named:
        named.add("num_classes")
    return {k for k in DATA_KEYS if k in named}


def sets(config_file: str | None, overrides: dict[str, Any], key: str) -> bool:
    """Whether `--config` or `--set` gives `key` a value (the user fixed it: it is not the preset's default)."""
    if overrides.get(key) is not None:
        return True
    return bool(config_file) and key in load_config_file(str(config_file))


def read_classes(path: Path | str | None, overrides: dict[str, Any]) -> None:
    """`--classes FILE` (one class name a line) into `overrides` as the federation's class_names."""
    if path is None:
        return
    from protofl.data.own import read_classes_file

    if overrides.get("class_names") is not None:
        raise ConfigError("--classes and --set class_names both name the classes: give one")
    overrides["class_names"] = read_classes_file(path, "--classes file")


def data_shape(fixed: set[str], config: Callable[[], Any]) -> dict[str, Any]:
    """`load_dataset`'s num_classes/in_shape: those of `config()` (the validated config) that the user fixed;
    empty where nothing is fixed (the data decides)."""
    if not fixed:
        return {}
    cfg = config()
    return {k: getattr(cfg, k) for k in fixed}


def print_whole(renderable: RenderableType) -> None:
    """Print tables to stdout: to a terminal at its width (columns fold); into a pipe or a file, whose width
    rich cannot know and takes as 80, at the renderable's own width, so every figure stays whole."""
    out = Console()
    if not out.is_terminal:
        out = Console(width=max(80, out.measure(renderable, options=out.options.update_width(1000)).maximum))
    out.print(renderable)
