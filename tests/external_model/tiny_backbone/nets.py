"""A tiny CNN backbone: the factory takes the input shape (c, h, w) and returns an nn.Module.

Its output is (n, 8, 2, 2), not flat: protofl flattens it to (n, 32) features and measures that width
itself, so the module needs no ``out_dim`` attribute.
"""

from torch import nn


def make(in_shape: tuple[int, int, int]) -> nn.Module:
    c = in_shape[0]
    return nn.Sequential(
        nn.Conv2d(c, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
    )
