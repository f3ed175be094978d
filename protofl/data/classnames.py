"""Class names of a dataset spec, for the labels a deployed model writes (numpy only).

A label file is read by people: "Sneaker" says more than "7". The names come from where the data says
them: Fashion-MNIST's published ones, an image folder's class folders (or its `classes=FILE`), an npz's
``class_names`` array; otherwise the class ids themselves.
"""

from __future__ import annotations

import numpy as np

from protofl.data import own
from protofl.errors import DataError
from protofl.names import class_key

__all__ = ["FASHION_MNIST_CLASSES", "class_names", "data_class_names"]

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
        return own.read_classes_file(opts["classes"])
    if (root / "train").is_dir() and (root / "test").is_dir():
        root = root / "train"
    if not root.is_dir():
        return None
    dirs = [d.name for d in own._class_dirs(root)]
    if dirs and all(n.isdigit() for n in dirs):
        return None  # the folder names are the class ids: nothing to add
    return dirs


def data_class_names(spec: str | None, num_classes: int) -> list[str] | None:
    """The names `spec`'s data gives its classes ids 0..num_classes-1, as it labels them when read without a
    federation's names (Fashion-MNIST's, an image folder's sorted class folders or its `classes=FILE`, an npz's
    ``class_names``); None where it does not name exactly `num_classes` distinct classes. A server that starts
    from its own data puts these in the federation's config (`start --public-data`, `simulate --dataset`)."""
    names = _names(spec)
    if names is None or len(names) != num_classes or len({class_key(n) for n in names}) != num_classes:
        return None
    return names


def class_names(spec: str | None, num_classes: int) -> list[str]:
    """One name per class id 0..num_classes-1 for data named by `spec` (ids as names where it has none)."""
    names = list(_names(spec) or [])
    return [names[i] if i < len(names) else str(i) for i in range(num_classes)]


def _names(spec: str | None) -> list[str] | None:
    kind, sep, arg = (spec or "").partition(":")
    kind = kind.strip().lower()
    try:
        if kind in ("fashion-mnist", "fashion_mnist", "fmnist") and not sep:
            return list(FASHION_MNIST_CLASSES)
        if kind == "imagefolder" and arg:
            return _imagefolder(arg)
        if kind == "npz" and arg:
            with np.load(own.path_of(arg), allow_pickle=False) as f:
                return [str(n) for n in f["class_names"]] if "class_names" in f.files else None
    except (OSError, ValueError, DataError):
        pass  # the names are a courtesy: data that reads for training but not here gets ids
    return None
