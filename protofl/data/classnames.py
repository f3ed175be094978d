"""Class names of a dataset spec, for the labels a deployed model writes (numpy only).

A label file is read by people: "Sneaker" says more than "7". The names come from where the data says
them: Fashion-MNIST's published ones, an image folder's class folders (or its `classes=FILE`), an npz's
``class_names`` array; otherwise the class ids themselves.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from protofl.data import own

__all__ = ["FASHION_MNIST_CLASSES", "class_names"]

# Xiao, Rasul and Vollgraf, "Fashion-MNIST", arXiv:1708.07747, Table 1 (labels 0-9).
FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)


def _imagefolder(arg: str) -> list[str] | None:
    root, opts = own._options(arg, "imagefolder", ("classes",))
    if "classes" in opts:
        return [ln.strip() for ln in Path(opts["classes"]).read_text().splitlines() if ln.strip()]
    if (root / "train").is_dir() and (root / "test").is_dir():
        root = root / "train"
    if not root.is_dir():
        return None
    dirs = [d.name for d in own._class_dirs(root)]
    if dirs and all(n.isdigit() for n in dirs):
        return None  # the folder names are the class ids: nothing to add
    return dirs


def class_names(spec: str | None, num_classes: int) -> list[str]:
    """One name per class id 0..num_classes-1 for data named by `spec` (ids as names where it has none)."""
    names: list[str] | None = None
    kind, sep, arg = (spec or "").partition(":")
    kind = kind.strip().lower()
    try:
        if kind in ("fashion-mnist", "fashion_mnist", "fmnist") and not sep:
            names = list(FASHION_MNIST_CLASSES)
        elif kind == "imagefolder" and arg:
            names = _imagefolder(arg)
        elif kind == "npz" and arg:
            with np.load(own.path_of(arg), allow_pickle=False) as f:
                names = [str(n) for n in f["class_names"]] if "class_names" in f.files else None
    except (OSError, ValueError):
        names = None  # the names are a courtesy: data that reads for training but not here gets ids
    names = list(names or [])
    return [names[i] if i < len(names) else str(i) for i in range(num_classes)]
