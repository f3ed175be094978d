"""What a device accepts from the server before adopting it (issue 14).

The broker's ACL lets only the server write `config` and `round`, but a compromised or buggy server,
or a broker run with --insecure, must still not be able to wedge a device: a config must fit what the
device can afford (memory of the prototype tables and adapter, sane optimiser settings, its own data's
shape), and anchors must be finite and of a magnitude training can survive. Anything else is refused
before any state changes; the agent keeps its previous config, model and anchors. numpy only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from protofl.config import FederationConfig


@dataclass(frozen=True)
class DeviceBudget:
    """Upper bounds a device puts on the federation's config and anchors."""

    max_table_values: int = 2**22  # num_classes * proto_dim: 16 MiB a float32 table (the probe: 4e9)
    max_input_values: int = 2**22  # channels * height * width of one sample
    max_local_epochs: int = 1000
    max_batch_size: int = 2**16
    max_lr: float = 10.0  # SGD steps beyond this diverge for every model here
    max_anchor_abs: float = 1e9  # TinyProto's scaled sums n_kc * p_kc reach ~1e7; 1e38 is an attack


DEFAULT_BUDGET = DeviceBudget()


def config_problem(
    cfg: FederationConfig, sample_shape: tuple[int, ...] | None = None, budget: DeviceBudget = DEFAULT_BUDGET
) -> str | None:
    """Why this device cannot adopt `cfg` (None if it can): sizes it cannot afford, settings that only
    diverge, an input shape that is not its data's (when `sample_shape` is known)."""
    table = cfg.num_classes * cfg.proto_dim
    if table > budget.max_table_values:
        return (
            f"num_classes * proto_dim = {cfg.num_classes} * {cfg.proto_dim} = {table:,} values a prototype "
            f"table, over this device's {budget.max_table_values:,}"
        )
    inputs = math.prod(cfg.in_shape)
    if inputs > budget.max_input_values:
        return (
            f"in_shape {tuple(cfg.in_shape)} has {inputs:,} values a sample, over this device's "
            f"{budget.max_input_values:,}"
        )
    if sample_shape is not None and (shape := shape_problem(cfg, sample_shape)) is not None:
        return shape
    if not 0 < cfg.lr <= budget.max_lr:
        return f"lr {cfg.lr} outside (0, {budget.max_lr}]"
    if not 0 <= cfg.momentum < 1:
        return f"momentum {cfg.momentum} outside [0, 1)"
    if not 0 <= cfg.weight_decay <= 1:
        return f"weight_decay {cfg.weight_decay} outside [0, 1]"
    if cfg.local_epochs > budget.max_local_epochs or cfg.batch_size > budget.max_batch_size:
        return (
            f"local_epochs {cfg.local_epochs} / batch_size {cfg.batch_size} over this device's "
            f"{budget.max_local_epochs} / {budget.max_batch_size}"
        )
    return None


def shape_problem(cfg: FederationConfig, sample_shape: tuple[int, ...]) -> str | None:
    """Why `cfg` does not fit this device's data (None if it does): its input shape is not the data's."""
    if tuple(cfg.in_shape) != tuple(sample_shape):
        return f"in_shape {tuple(cfg.in_shape)} is not the shape of this device's data {tuple(sample_shape)}"
    return None


def anchors_problem(values: np.ndarray, budget: DeviceBudget = DEFAULT_BUDGET) -> str | None:
    """Why these anchor values cannot be trained against (None if they can)."""
    v = np.asarray(values)
    if v.size == 0:
        return None
    if not np.isfinite(v).all():
        return "anchors contain NaN or inf"
    peak = float(np.abs(v).max())
    if peak > budget.max_anchor_abs:
        return f"anchor values up to {peak:.3g}, over this device's bound {budget.max_anchor_abs:.3g}"
    return None
