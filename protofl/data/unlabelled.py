"""Data to label: images without labels, for `protofl-edge predict --input` (numpy only).

The same formats a device trains on (protofl/data/own.py), read without the labels they do not have:

- ``npz:PATH``: array ``x`` (any image layout the loaders take; labels ignored), optional ``names`` (n,);
- ``imagefolder:DIR``: every image under DIR, sub-folders included (a class folder layout is fine too:
  the folder names are not used), named by its path relative to DIR, converted and resized to the
  model's input shape (Pillow: the ``device`` extra);
- ``csv:FILE[,label=COL][,name=COL][,range=LO:HI]``: a header row, then one sample a row; every column but
  the label column (ignored where present) and the name column is a feature, as for training;
- a bare path: an ``.npz`` or ``.csv`` file, a directory of images, or one image file.

A sample's name is what the label file says it is: its file, its ``names`` entry or name column, else its
index. Arrays must already have the model's shape (they are not resized); images and CSV rows adapt to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from protofl.data import own
from protofl.data.loaders import _images_to_nchw, _to_uint8, read_npz
from protofl.errors import DataError

__all__ = ["Unlabelled", "load_unlabelled"]

Shape = tuple[int, int, int]


@dataclass(frozen=True)
class Unlabelled:
    x: np.ndarray  # uint8 (n, c, h, w)
    names: list[str]  # one per sample
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (name, reason): files that could not be read

    def normalized(self, mean: tuple[float, ...] | None, std: tuple[float, ...] | None) -> np.ndarray:
        """float32 (x / 255 - mean) / std, as the model's inputs were during training (0/1 where unknown)."""
        c = self.x.shape[1]
        m = np.asarray(mean if mean else (0.0,) * c, np.float32).reshape(1, c, 1, 1)
        s = np.asarray(std if std else (1.0,) * c, np.float32).reshape(1, c, 1, 1)
        return ((self.x.astype(np.float32) / np.float32(255.0)) - m) / s


def _check(x: np.ndarray, in_shape: Shape, where: str) -> np.ndarray:
    if tuple(x.shape[1:]) != tuple(in_shape):
        raise DataError(
            f"{where}: images are {tuple(x.shape[1:])} (channels, height, width) but the model takes "
            f"{tuple(in_shape)}; arrays are not resized: bring them in that shape, or an image folder"
        )
    return x


def _npz(path: Path, in_shape: Shape) -> Unlabelled:
    arrays = read_npz(path, "npz to label")
    if "x" not in arrays:
        raise DataError(f"{path}: no array 'x' (the images to label); found {sorted(arrays)}")
    x = _check(_to_uint8(_images_to_nchw(arrays["x"], f"{path}[x]"), f"{path}[x]"), in_shape, str(path))
    names = [str(n) for n in arrays["names"]] if "names" in arrays else [str(i) for i in range(len(x))]
    if len(names) != len(x):
        raise DataError(f"{path}: {len(names)} names for {len(x)} images")
    return Unlabelled(x, names)


def _images(root: Path, in_shape: Shape) -> Unlabelled:
    if root.is_file():
        files, base = [root], root.parent
    else:
        files, base = (
            sorted(
                p
                for p in root.rglob("*")
                if p.is_file()
                and p.suffix.lower() in own.IMAGE_SUFFIXES
                and not any(part.startswith(".") for part in p.relative_to(root).parts)
            ),
            root,
        )
    if not files:
        raise DataError(f"{root}: no images ({', '.join(own.IMAGE_SUFFIXES)}) to label")
    if in_shape[0] not in (1, 3):
        raise DataError(f"images decode to 1 (L) or 3 (RGB) channels; the model takes {in_shape[0]}")
    got = own.decode_images(files, in_shape, strict=False)  # unreadable files are listed, the rest labelled
    if not got.kept:
        raise DataError(f"{root}: none of its {len(files)} image files can be decoded ({got.skipped[0][1]})")
    return Unlabelled(
        got.x,
        [files[i].relative_to(base).as_posix() for i in got.kept],
        [(p.relative_to(base).as_posix(), reason) for p, reason in got.skipped],
    )


def _csv(arg: str, in_shape: Shape, scaling: dict[str, Any] | None = None) -> Unlabelled:
    path, opts = own._options(arg, "csv", ("label", "name", "range"))
    lo_hi = own.csv_range(opts)
    header, body = own.csv_rows(path)
    drop = [header.index(c) for c in (opts.get("label", "label"), opts.get("name")) if c and c in header]
    if "name" in opts and opts["name"] not in header:
        raise DataError(f"csv {path}: no name column {opts['name']!r}; columns are {header[:12]}")
    keep = [i for i in range(len(header)) if i not in drop]
    if scaling is not None:  # the model's inputs were standardised per column: the same columns, the same way
        missing = [c for c in scaling["columns"] if c not in header]
        if missing:
            raise DataError(f"csv {path}: the model was trained on columns it lacks: {missing[:6]}")
        keep = [header.index(c) for c in scaling["columns"]]
    table = own.csv_table(path, header, body, keep)
    shape = own._csv_shape(table.shape[1], in_shape, path)
    if scaling is not None:
        x = own.csv_scale(table, scaling).reshape((len(body), *shape))
    else:
        x = own._csv_pixels(table, lo_hi, path).reshape((len(body), *shape))
    names = [r[header.index(opts["name"])] for r in body] if "name" in opts else [str(i) for i in range(len(body))]
    return Unlabelled(x, names)


def load_unlabelled(spec: str, in_shape: Shape, csv_scaling: dict[str, Any] | None = None) -> Unlabelled:
    """The images named by `spec` (module docstring) in the model's input shape `in_shape` (c, h, w);
    `csv_scaling`: the per-column standardisation the model was trained with (a CSV's rows get the same)."""
    kind, sep, arg = spec.partition(":")
    kind = kind.strip().lower()
    if sep and kind == "npz":
        return _npz(Path(arg), in_shape)
    if sep and kind == "imagefolder":
        root = Path(own.path_of(arg))
        if not root.is_dir():
            raise DataError(f"image folder to label not found: {root} does not exist or is not a directory")
        return _images(root, in_shape)
    if sep and kind == "csv":
        return _csv(arg, in_shape, csv_scaling)
    p = Path(spec)
    if not p.exists():
        raise DataError(
            f"--input '{spec}': not found; give npz:PATH, imagefolder:DIR, csv:FILE, or a path to an "
            ".npz, a .csv, a folder of images or one image"
        )
    if p.is_file() and p.suffix.lower() == ".npz":
        return _npz(p, in_shape)
    if p.is_file() and p.suffix.lower() == ".csv":
        return _csv(str(p), in_shape, csv_scaling)
    if p.is_dir() or p.suffix.lower() in own.IMAGE_SUFFIXES:
        return _images(p, in_shape)
    raise DataError(f"--input '{spec}': cannot tell the format of {p}; name it: npz:PATH, imagefolder:DIR, csv:FILE")
