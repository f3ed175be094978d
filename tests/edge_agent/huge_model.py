"""A backbone too large for a Raspberry Pi 3 (tests/edge_agent/test_memory_limit.py): 254 M float32 weights, ~1 GB."""

from torch import nn


def make(in_shape: tuple[int, int, int]) -> nn.Module:
    c, h, w = in_shape
    return nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, 300_000), nn.ReLU(), nn.Linear(300_000, 64))
