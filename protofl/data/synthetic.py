"""A seeded synthetic image dataset for tests, smoke runs and offline demos (numpy only).

Each class has a template: a background shared by all classes plus a few class-specific smooth Gaussian
blobs. A sample is its class template, randomly shifted by a few pixels, rescaled in contrast, with a
random distractor blob and per-pixel Gaussian noise. Because the class signal is partly shared and every
sample moves and is noisy, a linear model on raw pixels is clearly above chance but far from perfect,
while a small CNN (translation tolerant) learns it within a couple of epochs: enough to tell a working
training loop from a broken one without downloading anything.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from protofl.data.dataset import Dataset, channel_stats
from protofl.errors import DataError

__all__ = ["make_synthetic"]

_MAX_SHIFT = 4  # pixels, each axis


def _blobs(rng: np.random.Generator, n: int, count: int, shape: tuple[int, int, int]) -> np.ndarray:
    """n images (n, c, h, w) in [0, 1], each the max of ``count`` random Gaussian blobs per channel."""
    c, h, w = shape
    yy = np.arange(h, dtype=np.float32)[:, None]
    xx = np.arange(w, dtype=np.float32)[None, :]
    out = np.zeros((n, c, h, w), dtype=np.float32)
    for _ in range(count):
        cy = rng.uniform(0.15 * h, 0.85 * h, size=(n, c, 1, 1)).astype(np.float32)
        cx = rng.uniform(0.15 * w, 0.85 * w, size=(n, c, 1, 1)).astype(np.float32)
        sigma = rng.uniform(0.06, 0.14, size=(n, c, 1, 1)).astype(np.float32) * min(h, w)
        amp = rng.uniform(0.5, 1.0, size=(n, c, 1, 1)).astype(np.float32)
        blob = amp * np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * sigma**2))
        np.maximum(out, blob, out=out)
    return out


def make_synthetic(
    num_classes: int = 10,
    n_train: int = 2000,
    n_test: int = 500,
    shape: Sequence[int] = (1, 28, 28),
    seed: int = 0,
    noise: float = 0.25,
) -> tuple[Dataset, Dataset]:
    """(train, test) synthetic uint8 images; same arguments -> identical arrays.

    Labels are balanced (each class appears n // num_classes or one more times), in a seeded random
    order. ``noise`` is the per-pixel Gaussian noise std in [0, 1] intensity units.
    """
    if num_classes < 2:
        raise DataError(f"synthetic dataset needs at least 2 classes, got {num_classes}")
    if n_train < 1 or n_test < 1:
        raise DataError(f"synthetic dataset needs n_train >= 1 and n_test >= 1, got {n_train}, {n_test}")
    if len(shape) != 3 or min(shape) < 1:
        raise DataError(f"synthetic shape must be (channels, height, width), got {tuple(shape)}")
    if not noise >= 0:
        raise DataError(f"synthetic noise must be >= 0, got {noise}")
    c, h, w = (int(v) for v in shape)
    rng = np.random.default_rng(seed)

    # Templates: one shared background (so that classes are not separable by overall brightness alone)
    # plus three class-specific blobs.
    background = 0.6 * _blobs(rng, 1, 3, (c, h, w))
    templates = np.maximum(background, _blobs(rng, num_classes, 3, (c, h, w)))

    n = n_train + n_test
    labels = rng.permutation(np.arange(n) % num_classes).astype(np.int64)

    # Random translation by up to _MAX_SHIFT pixels: crop windows out of edge-padded templates with one
    # fancy-indexing gather (no Python loop over samples).
    s = _MAX_SHIFT
    padded = np.pad(templates, ((0, 0), (0, 0), (s, s), (s, s)), mode="constant")
    dy = rng.integers(0, 2 * s + 1, size=n)
    dx = rng.integers(0, 2 * s + 1, size=n)
    rows = (dy[:, None] + np.arange(h)[None, :])[:, None, :, None]
    cols = (dx[:, None] + np.arange(w)[None, :])[:, None, None, :]
    x = padded[labels[:, None, None, None], np.arange(c)[None, :, None, None], rows, cols]

    contrast = rng.uniform(0.6, 1.2, size=(n, 1, 1, 1)).astype(np.float32)
    x *= contrast
    # Two distractor blobs per sample, at a random place: class-independent structure to ignore.
    np.maximum(x, 0.7 * _blobs(rng, n, 2, (c, h, w)), out=x)
    x += rng.normal(0.0, noise, size=x.shape).astype(np.float32)
    np.clip(x, 0.0, 1.0, out=x)
    images = np.rint(x * 255.0).astype(np.uint8)

    mean, std = channel_stats(images[:n_train])
    name = "synthetic"
    train = Dataset(images[:n_train], labels[:n_train], num_classes, name, mean, std)
    test = Dataset(images[n_train:], labels[n_train:], num_classes, name, mean, std)
    return train, test
