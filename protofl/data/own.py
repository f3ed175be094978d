"""A field trial's own data: image folders, CSV files and a loader function of one's own.

Each reader returns the npz layout (``x``, ``y``, optionally ``x_test``, ``y_test``) and a name;
``protofl.data.loaders`` finishes it like an npz (labels checked against the federation's classes,
a held-out test split where the data has none, normalisation statistics).

- ``imagefolder:DIR[,classes=FILE]``: one sub-folder per class holding png/jpg/... images of any size
  and mode, decoded with Pillow (the ``device`` extra; imported only here, when an image folder is read),
  converted to L (1 channel) or RGB (3) and resized to the federation's in_shape. Labels: where the
  federation names its classes (its config's ``class_names``), a folder's label is the id of the class it
  names (matched ignoring case, spaces and punctuation: ``ankle-boot`` is "Ankle boot"), a number names the id
  itself, and any other name is refused; a ``classes=FILE`` of the device's own must then list the
  federation's names, in its order. Where the federation has no names: with ``classes=FILE`` (the
  federation's class names, one a line) a folder's label is its line; else, when every folder name is a
  number, that number (so a device may hold any subset: folders 0, 3, 7); else its position among the
  sorted folder names, which is only right when the device holds every class folder: fewer named folders
  than the federation has classes are refused (their order cannot say which classes they are).
  ``DIR/train`` and ``DIR/test`` both present: they are the train and test splits; ``DIR/train`` alone: the
  train split (a test split is held out of it). A file Pillow cannot decode (empty, truncated, or declaring
  more than MAX_IMAGE_PIXELS: a decompression bomb) is skipped and counted, a file of another suffix
  (README.txt) listed; more than MAX_UNREADABLE (half) of the image files unreadable stops loading;
  ``strict=true``: the first unreadable file does. The log says how many images were loaded, skipped (with
  the reasons) and converted (mode, size).
- ``csv:FILE[,label=COL][,range=LO:HI][,test=FILE][,scale=column|pixels]``: a header row, then one sample a
  row: the label column (``label`` unless named) holds integer class ids, or class names where the
  federation has them (matched as folder names are), every other column is a feature, in (channel, row,
  column) order of the federation's in_shape. Features that are pixel values (integers 0..255, or all in
  [0, 1]) are taken as they are (``scale=pixels`` insists); ``range=LO:HI`` maps [LO, HI] linearly onto
  0..255 (values outside are clipped; the same fixed range on every device, so that all of them see the
  same features); any other values (``scale=column`` insists) are standardised per column with the mean
  and std of the training file, clipped to +-CSV_Z standard deviations: :func:`csv_scaling` gives that
  scaling, stored with the device's artifacts, so that predict applies the same. ``test=FILE``: the test
  split, same header. A cell that is not a number (a label that is neither a class id nor a name) is an
  error naming its line and column.
- ``package.module:function``: see :func:`read_loader`.

numpy only at import time (Pillow is imported lazily by the image folder reader).
"""

from __future__ import annotations

import csv
import importlib
import inspect
import logging
import math
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from protofl.errors import DataError
from protofl.names import class_key

log = logging.getLogger("protofl.data")

__all__ = [
    "IMAGE_SUFFIXES",
    "KINDS",
    "LOADER",
    "SKIPPED_KEY",
    "is_loader",
    "label_map",
    "read",
    "read_classes_file",
    "read_csv",
    "read_imagefolder",
    "read_loader",
]

KINDS = ("imagefolder", "csv")
LOADER = "loader"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")
_LOADER_RE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")

Arrays = dict[str, np.ndarray]


def is_loader(spec: str) -> bool:
    """``package.module:function`` (a dotted module path, a colon, a function name)."""
    return _LOADER_RE.fullmatch(spec.strip()) is not None


def path_of(arg: str) -> str:
    """The path of an ``imagefolder:`` / ``csv:`` argument (before its first comma)."""
    return arg.split(",", 1)[0].strip()


def read(
    kind: str,
    arg: str,
    in_shape: tuple[int, ...] | None,
    *,
    num_classes: int | None = None,
    seed: int = 0,
    class_names: Sequence[str] | None = None,
) -> tuple[Arrays, str]:
    """`class_names`: the federation's, where it names its classes (labels are matched by name)."""
    if kind == "imagefolder":
        return read_imagefolder(arg, in_shape, class_names=class_names, num_classes=num_classes)
    if kind == "csv":
        return read_csv(arg, in_shape, class_names=class_names)
    return read_loader(arg, in_shape, num_classes=num_classes, seed=seed)


def read_classes_file(path: str | Path, what: str = "classes file") -> list[str]:
    """The class names of a classes file: one a line, blank lines skipped; the line (from 0) is the class id."""
    p = Path(path)
    try:
        names = [line.strip() for line in p.read_text().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{what} not found or unreadable: {p} ({getattr(e, 'strerror', None) or e})") from None
    if not names:
        raise DataError(f"{what} {p} names no class: one class name a line, the first is class 0")
    return names


def listed(names: Sequence[str], most: int = 20) -> str:
    """Names for a message: all of them up to `most`, in order."""
    return ", ".join(names[:most]) + (f", ... ({len(names)} in all)" if len(names) > most else "")


def label_map(found: Sequence[str], federation: Sequence[str], where: str, what: str) -> dict[str, int]:
    """Each name in `found` (class folders, a CSV's label strings) -> the id of the federation's class it names:
    matched by `class_key` (case, spaces and punctuation ignored), else a number names the id itself; a name
    the federation does not have is a DataError that lists its classes."""
    exact = {n: i for i, n in enumerate(federation)}
    keyed = {class_key(n): i for i, n in enumerate(federation)}
    out: dict[str, int] = {}
    unknown: list[str] = []
    for name in found:
        i = exact.get(name, keyed.get(class_key(name)))
        if i is None and name.strip().isdigit() and int(name) < len(federation):
            i = int(name)
        if i is None:
            unknown.append(name)
        else:
            out[name] = i
    if unknown:
        raise DataError(
            f"{where}: {what} {unknown} {'is' if len(unknown) == 1 else 'are'} not among this federation's "
            f"{len(federation)} classes ({listed(federation)}); name each after one of them (case, spaces and "
            f"punctuation do not matter) or give its class id 0..{len(federation) - 1}, or leave it out"
        )
    return out


def _options(arg: str, what: str, keys: tuple[str, ...]) -> tuple[Path, dict[str, str]]:
    path, *items = arg.split(",")
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in items)):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in keys:
            raise DataError(
                f"bad {what} option {item!r}; use key=value with keys {', '.join(keys)} "
                f"(e.g. {what}:PATH,{keys[0]}=...)"
            )
        out[key.strip()] = value.strip()
    return Path(path.strip()), out


# ---------------------------------------------------------------------------------------------------
# imagefolder:DIR
# ---------------------------------------------------------------------------------------------------


def _pillow() -> Any:
    try:
        from PIL import Image
    except ImportError:
        raise DataError(
            "imagefolder: decoding images needs Pillow: pip install 'protofl-edge[device]' (or pip install Pillow)"
        ) from None
    return Image


# The most pixels an image file may declare (issue 43): its header is read before its pixels, so a small PNG that
# claims 50000x50000 is skipped as unreadable (with the other unreadable files) before Pillow allocates them.
# Pillow's own bomb check (DecompressionBombError, at twice its MAX_IMAGE_PIXELS) is caught the same way.
MAX_IMAGE_PIXELS = 64_000_000


class _TooLarge(Exception):
    """An image file that declares more pixels than MAX_IMAGE_PIXELS (its message names the size)."""


def _check_pixels(img: Any, path: Path) -> None:
    w, h = img.size
    if w * h > MAX_IMAGE_PIXELS:
        raise _TooLarge(
            f"declares {w}x{h} pixels, more than {MAX_IMAGE_PIXELS:,} (a decompression bomb?): refused before decoding"
        )


def _class_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def _labels_of(
    dirs: list[Path],
    names: list[str] | None,
    where: Path,
    federation: Sequence[str] | None = None,
    num_classes: int | None = None,
) -> dict[str, int]:
    """Folder name -> label (see the module docstring)."""
    found = [d.name for d in dirs]
    if federation is not None:
        index = label_map(found, federation, str(where), "class folder(s)")
        by_id: dict[int, list[str]] = {}
        for name, i in index.items():
            by_id.setdefault(i, []).append(name)
        doubles = [f"{ns} are all '{federation[i]}'" for i, ns in sorted(by_id.items()) if len(ns) > 1]
        if doubles:
            raise DataError(f"{where}: class folders {'; '.join(doubles)}: one folder per class")
        return index
    if names is not None:
        index = {n: i for i, n in enumerate(names)}
        unknown = [n for n in found if n not in index]
        if unknown:
            raise DataError(
                f"{where}: folder(s) {unknown} are not in the classes file ({len(names)} names: "
                f"{', '.join(names[:10])}{', ...' if len(names) > 10 else ''})"
            )
        return {n: index[n] for n in found}
    if found and all(n.isdigit() for n in found):
        return {n: int(n) for n in found}
    if num_classes is not None and len(found) < num_classes:
        raise DataError(
            f"{where}: {len(found)} named class folder(s) ({listed(found)}) in a federation of {num_classes} "
            f"classes that names none: their sorted order cannot say which classes they are. Start the server "
            f"with --classes FILE (one class name a line: every device's folders are then matched by name), or "
            f"give this device the federation's list: imagefolder:DIR,classes=FILE"
        )
    return {n: i for i, n in enumerate(found)}


# More than this share of a folder's image files unreadable stops loading: that is the wrong folder or a format
# Pillow cannot read, not a few broken files (a handful among many is skipped and counted).
MAX_UNREADABLE = 0.5
# The key under which `read_imagefolder` gives the count of files it skipped (`Dataset.skipped_files`; a device
# sends it in `Metrics.extra` under the same name, the server shows it: `protofl-server status`, --metrics-port).
SKIPPED_KEY = "skipped_files"


@dataclass
class Decoded:
    """Images decoded from files: the readable ones (``x``, uint8 (n, c, h, w)), which files they are
    (``kept``: indices into the paths given), the unreadable ones with the reason and what was converted."""

    x: np.ndarray
    kept: list[int]
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    converted: Counter[str] = field(default_factory=Counter)


def _is_strict(opts: dict[str, str], what: str) -> bool:
    value = opts.get("strict", "false").lower()
    if value not in ("true", "1", "yes", "false", "0", "no"):
        raise DataError(f"{what} option strict={opts['strict']}: use strict=true or strict=false")
    return value in ("true", "1", "yes")


def decode_images(paths: list[Path], in_shape: tuple[int, ...], *, strict: bool = False) -> Decoded:
    """Decode `paths` to `in_shape` (c, h, w): converted to L or RGB, resized. A file Pillow cannot read is
    skipped with its reason (``strict``: the first one is an error); more than MAX_UNREADABLE of them is an
    error either way."""
    image_mod = _pillow()
    c, h, w = in_shape
    mode = {1: "L", 3: "RGB"}[c]
    out = np.empty((len(paths), h, w, c), dtype=np.uint8)
    kept: list[int] = []
    skipped: list[tuple[Path, str]] = []
    converted: Counter[str] = Counter()
    for i, p in enumerate(paths):
        try:
            with image_mod.open(p) as img:
                _check_pixels(img, p)
                if img.mode != mode:
                    converted[f"{img.mode} to {mode}"] += 1
                img = img.convert(mode)
                if img.size != (w, h):
                    converted[f"resized from {img.size[0]}x{img.size[1]}"] += 1
                    img = img.resize((w, h), image_mod.Resampling.BILINEAR)
                out[len(kept)] = np.asarray(img, dtype=np.uint8).reshape(h, w, c)
            kept.append(i)
        except (_TooLarge, image_mod.DecompressionBombError) as e:
            reason = f"too large to decode: {e}" if not isinstance(e, _TooLarge) else str(e)
            if strict:
                raise DataError(f"{p}: {reason} (strict: the first unreadable file stops loading)") from None
            skipped.append((p, reason))
        except (OSError, ValueError, SyntaxError) as e:
            reason = "empty file" if p.is_file() and p.stat().st_size == 0 else f"cannot decode as an image: {e}"
            if strict:
                raise DataError(f"{p}: {reason} (strict: the first unreadable file stops loading)") from None
            skipped.append((p, reason))
    if paths and len(skipped) > MAX_UNREADABLE * len(paths):
        first = "; ".join(f"{p.name}: {r}" for p, r in skipped[:3])
        raise DataError(
            f"{len(skipped)} of {len(paths)} image files are unreadable (more than {MAX_UNREADABLE:.0%}: the wrong "
            f"folder, or a format Pillow cannot read?); first: {first}"
        )
    x = np.ascontiguousarray(out[: len(kept)].transpose(0, 3, 1, 2))
    return Decoded(x, kept, skipped, converted)


def _decode(paths: list[Path], in_shape: tuple[int, ...]) -> np.ndarray:
    """Every one of `paths` decoded (the first unreadable file is an error)."""
    return decode_images(paths, in_shape, strict=True).x


def describe_load(where: str | Path, loaded: int, decoded: list[Decoded], others: list[Path]) -> str:
    """One line: how many images were loaded, skipped (each with its reason, the first few) and converted."""
    skipped = [s for d in decoded for s in d.skipped]
    converted: Counter[str] = sum((d.converted for d in decoded), Counter())
    text = f"{where}: loaded {loaded} image(s)"
    if skipped or others:
        reasons = [f"{p.parent.name}/{p.name} ({r})" for p, r in skipped]
        reasons += [f"{p.parent.name}/{p.name} (not an image file)" for p in others]
        more = f", ... {len(reasons) - 5} more" if len(reasons) > 5 else ""
        text += f"; skipped {len(skipped) + len(others)}: {', '.join(reasons[:5])}{more}"
    if converted:
        text += "; converted " + ", ".join(f"{n} {k}" for k, n in sorted(converted.items()))
    return text


def _first_shape(paths: list[Path]) -> tuple[int, int, int]:
    """in_shape when the federation gives none: the first readable image's size, 1 channel if it is grey,
    else 3."""
    image_mod = _pillow()
    for path in paths:
        try:
            with image_mod.open(path) as img:
                _check_pixels(img, path)
                c = 1 if img.mode in ("1", "L", "LA", "I", "I;16", "F") else 3
                return (c, img.size[1], img.size[0])
        except (OSError, ValueError, SyntaxError, _TooLarge, image_mod.DecompressionBombError):
            continue
    raise DataError(f"{paths[0].parent.parent}: none of its {len(paths)} image files can be decoded")


def read_imagefolder(
    arg: str,
    in_shape: tuple[int, ...] | None,
    *,
    class_names: Sequence[str] | None = None,
    num_classes: int | None = None,
) -> tuple[Arrays, str]:
    """The npz layout from ``DIR[,classes=FILE][,strict=true]`` (module docstring); `class_names`: the
    federation's."""
    d, opts = _options(arg, "imagefolder", ("classes", "strict"))
    strict = _is_strict(opts, "imagefolder")
    if not d.is_dir():
        raise DataError(f"image folder not found: {d} does not exist or is not a directory")
    names: list[str] | None = None
    if "classes" in opts:
        names = read_classes_file(opts["classes"], "imagefolder classes file")
        if class_names is not None and [class_key(n) for n in names] != [class_key(n) for n in class_names]:
            raise DataError(
                f"imagefolder {d}: its classes file {opts['classes']} names {len(names)} classes ({listed(names)}), "
                f"but this federation's {len(class_names)} classes are ({listed(class_names)}), in that order (a "
                f"line is a class id): leave classes= out (the federation's names are used) or make the file the "
                f"federation's list"
            )
    splits = {"x": d / "train", "x_test": d / "test"}
    if not (splits["x"].is_dir() and splits["x_test"].is_dir()):
        # DIR/train alone (no test/): the train split, a test split is held out of it
        splits = {"x": d / "train"} if [c.name for c in _class_dirs(d)] == ["train"] else {"x": d}
    others: list[Path] = []
    files: dict[str, list[Path]] = {}
    labels: dict[str, list[int]] = {}
    index: dict[str, int] = {}
    for key, root in splits.items():
        dirs = _class_dirs(root)
        if not dirs:
            raise DataError(
                f"{root}: no class folders; an image folder holds one sub-folder per class "
                f"(DIR/<class>/<image>.png), optionally under DIR/train and DIR/test"
            )
        if key == "x":
            index = _labels_of(dirs, names, root, class_names, num_classes)
        elif class_names is not None:  # a test folder may hold a class the train folder lacks: named, it is known
            index = {**index, **_labels_of(dirs, names, root, class_names)}
        else:  # the test split is labelled like the train split (it may hold fewer classes)
            unknown = [d.name for d in dirs if d.name not in index]
            if unknown:
                raise DataError(f"{root}: class folder(s) {unknown} are not in {splits['x']} ({', '.join(index)})")
        files[key], labels[key] = [], []
        for cdir in dirs:
            entries = sorted(p for p in cdir.iterdir() if p.is_file() and not p.name.startswith("."))
            imgs = [p for p in entries if p.suffix.lower() in IMAGE_SUFFIXES]
            others += [p for p in entries if p.suffix.lower() not in IMAGE_SUFFIXES]
            files[key] += imgs
            labels[key] += [index[cdir.name]] * len(imgs)
        if not files[key]:
            raise DataError(f"{root}: no images ({', '.join(IMAGE_SUFFIXES)}) in its class folders")
    shape = tuple(in_shape) if in_shape is not None else _first_shape(files["x"])
    if len(shape) != 3 or shape[0] not in (1, 3):
        raise DataError(
            f"imagefolder {d}: images decode to 1 (L) or 3 (RGB) channels, but the federation's "
            f"in_shape is {shape}; use --set in_shape=1,H,W or 3,H,W"
        )
    arrays: Arrays = {}
    decoded: list[Decoded] = []
    for key in splits:
        got = decode_images(files[key], shape, strict=strict)
        if not got.kept:
            raise DataError(f"{splits[key]}: none of its {len(files[key])} image files can be decoded")
        decoded.append(got)
        arrays[key] = got.x
        arrays["y" if key == "x" else "y_test"] = np.asarray(labels[key], dtype=np.int64)[got.kept]
    loaded = sum(len(a) for k, a in arrays.items() if k in splits)
    splits_text = " + ".join(f"{len(arrays[k])} {splits[k].name}" for k in splits) if len(splits) > 1 else ""
    summary = describe_load(d, loaded, decoded, others) + (f" ({splits_text})" if splits_text else "")
    (log.warning if any(g.skipped for g in decoded) or others else log.info)("%s", summary)
    # How many files were skipped (unreadable or not images): the device reports it (Metrics.extra[SKIPPED_KEY])
    arrays[SKIPPED_KEY] = np.asarray(sum(len(g.skipped) for g in decoded) + len(others), dtype=np.int64)
    return arrays, d.name or "imagefolder"


# ---------------------------------------------------------------------------------------------------
# csv:FILE
# ---------------------------------------------------------------------------------------------------


def _csv_shape(n: int, in_shape: tuple[int, ...] | None, where: Path) -> tuple[int, ...]:
    if in_shape is None:
        side = math.isqrt(n)
        return (1, side, side) if side * side == n else (1, 1, n)
    if math.prod(in_shape) != n:
        c, h, w = in_shape
        raise DataError(
            f"csv {where}: {n} feature columns, but the federation's in_shape {tuple(in_shape)} needs "
            f"{c}x{h}x{w} = {math.prod(in_shape)} (channels x height x width, in that order)"
        )
    return tuple(in_shape)


def _csv_pixels(v: np.ndarray, lo_hi: tuple[float, float] | None, where: Path) -> np.ndarray:
    if not np.all(np.isfinite(v)):
        raise DataError(f"csv {where}: features contain NaN or inf")
    if lo_hi is not None:
        lo, hi = lo_hi
        return np.rint(np.clip((v - lo) / (hi - lo), 0.0, 1.0) * 255.0).astype(np.uint8)
    vmin, vmax = (float(v.min()), float(v.max())) if v.size else (0.0, 0.0)
    if np.all(v == np.rint(v)) and vmin >= 0 and vmax <= 255:
        return v.astype(np.uint8)
    if vmin >= 0 and vmax <= 1:
        return np.rint(v * 255.0).astype(np.uint8)
    raise DataError(
        f"csv {where}: features range over [{vmin:g}, {vmax:g}]; they must be integers 0..255 or "
        f"values in [0, 1], or name their range: csv:{where},range={vmin:g}:{vmax:g} (the same range "
        f"on every device), or standardise each column: scale=column"
    )


def csv_range(opts: dict[str, str]) -> tuple[float, float] | None:
    """The ``range=LO:HI`` option of a csv spec, checked (None without one)."""
    if "range" not in opts:
        return None
    try:
        lo_text, hi_text = opts["range"].split(":")
        lo_hi = (float(lo_text), float(hi_text))
    except ValueError:
        raise DataError(f"csv range must be LO:HI (e.g. range=-1:1), got {opts['range']!r}") from None
    if not lo_hi[1] > lo_hi[0]:
        raise DataError(f"csv range {opts['range']}: need LO < HI")
    return lo_hi


# The widest CSV read (issue 43): a 3x256x256 image as pixel columns plus its label. The header line's width is
# checked before any row is parsed, and every line is read within MAX_CSV_LINE characters, so a file of a million
# columns is refused before it becomes a million strings per row.
MAX_CSV_COLUMNS = 3 * 256 * 256 + 1
MAX_CSV_LINE = 64 << 20


def _csv_lines(f: Any, path: Path) -> Iterator[str]:
    """The physical lines of `f`, each refused when longer than MAX_CSV_LINE characters or wider (by its
    commas) than MAX_CSV_COLUMNS; the first line that is not blank (the header) by its parsed width."""
    header_seen = False
    while line := f.readline(MAX_CSV_LINE + 1):
        if len(line) > MAX_CSV_LINE:
            raise DataError(f"csv {path}: a line longer than {MAX_CSV_LINE} characters; refused before parsing it")
        if line.count(",") >= MAX_CSV_COLUMNS and (header_seen or len(next(csv.reader([line]), [])) > MAX_CSV_COLUMNS):
            what = "a line" if header_seen else "the header line"
            raise DataError(
                f"csv {path}: {what} has more than {MAX_CSV_COLUMNS} columns (the most protofl reads: a "
                "3x256x256 image and its label); refused before reading the rows"
            )
        header_seen = header_seen or bool(line.strip())
        yield line


def csv_rows(path: Path) -> tuple[list[str], list[list[str]]]:
    """(header, sample rows) of a CSV file: blank lines skipped, every row as long as the header."""
    try:
        with path.open(newline="") as f:
            rows = [r for r in csv.reader(_csv_lines(f, path)) if r and any(c.strip() for c in r)]
    except FileNotFoundError:
        raise DataError(f"csv file not found: {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read as CSV ({e})") from None
    if len(rows) < 2:
        raise DataError(f"csv {path}: need a header row and at least one sample row, got {len(rows)} row(s)")
    header = [h.strip() for h in rows[0]]
    for n, r in enumerate(rows[1:], start=2):
        if len(r) != len(header):
            raise DataError(f"csv {path} line {n}: {len(r)} fields, the header has {len(header)}")
    return header, rows[1:]


# Column standardisation: z = (value - mean) / std per column, clipped to +-CSV_Z and mapped onto 0..255.
CSV_Z = 4.0
CSV_SCALES = ("column", "pixels")


def csv_table(path: Path, header: list[str], body: list[list[str]], columns: list[int]) -> np.ndarray:
    """The float table of `columns` of `body`; a cell that is not a number is an error naming its line and
    column."""
    out = np.empty((len(body), len(columns)), dtype=np.float64)
    for n, row in enumerate(body):
        for j, ci in enumerate(columns):
            try:
                out[n, j] = float(row[ci])
            except ValueError:
                raise DataError(
                    f"csv {path} line {n + 2}, column {header[ci]!r} (column {ci + 1}): {row[ci]!r} is not a number"
                ) from None
    return out


def csv_scale(v: np.ndarray, scaling: dict[str, Any]) -> np.ndarray:
    """Rows `v` (columns in the scaling's order) standardised by `scaling` (see :func:`csv_scaling`), as uint8."""
    mean, std = np.asarray(scaling["mean"], np.float64), np.asarray(scaling["std"], np.float64)
    z = np.clip((v - mean) / std, -CSV_Z, CSV_Z)
    return np.rint((z + CSV_Z) / (2 * CSV_Z) * 255.0).astype(np.uint8)


def _fit_scaling(v: np.ndarray, columns: list[str]) -> dict[str, Any]:
    std = v.std(axis=0) if len(v) else np.ones(v.shape[1])
    return {
        "kind": "column",
        "columns": columns,
        "mean": [float(m) for m in (v.mean(axis=0) if len(v) else np.zeros(v.shape[1]))],
        "std": [float(s) if s > 0 else 1.0 for s in std],
        "clip_z": CSV_Z,
    }


def _looks_like_pixels(v: np.ndarray) -> bool:
    vmin, vmax = (float(v.min()), float(v.max())) if v.size else (0.0, 0.0)
    return bool((np.all(v == np.rint(v)) and vmin >= 0 and vmax <= 255) or (vmin >= 0 and vmax <= 1))


def _read_csv_split(path: Path, label: str) -> tuple[list[str], np.ndarray, list[str]]:
    """(feature column names, features, label cells) of one CSV file."""
    header, body = csv_rows(path)
    if label not in header:
        raise DataError(
            f"csv {path}: no label column {label!r}; columns are {header[:12]}"
            f"{' ...' if len(header) > 12 else ''}; name it with csv:{path},label=COLUMN"
        )
    li = header.index(label)
    keep = [i for i in range(len(header)) if i != li]
    return [header[i] for i in keep], csv_table(path, header, body, keep), [r[li].strip() for r in body]


def _csv_labels(cells: list[str], path: Path, label: str, class_names: Sequence[str] | None) -> np.ndarray:
    """A label column: integer class ids, or class names matched with the federation's; a cell that is
    neither is an error naming its line."""
    named = [n for n, c in enumerate(cells) if not _is_number(c)]
    if named:
        if class_names is None:
            names = sorted({cells[n] for n in named})
            raise DataError(
                f"csv {path}: column {label!r} holds class names ({listed(names, 10)}), but this federation names "
                f"no classes to match them with (the first: line {named[0] + 2}, {cells[named[0]]!r}): start the "
                f"server with --classes FILE (one class name a line), or write class ids 0, 1, ... in the column"
            )
        index = label_map(sorted(set(cells)), class_names, f"csv {path}", f"label(s) in column {label!r}")
        return np.array([index[c] for c in cells], dtype=np.int64)
    y = np.array([float(c) for c in cells], dtype=np.float64)
    bad = ~np.isfinite(y) | (y != np.rint(y))
    if np.any(bad):
        n = int(np.argmax(bad))
        raise DataError(
            f"csv {path} line {n + 2}, column {label!r}: {cells[n]!r}; the label column must hold integer "
            "class ids (0, 1, ...) or class names"
        )
    return y.astype(np.int64)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _csv_options(arg: str) -> tuple[Path, dict[str, str], str]:
    path, opts = _options(arg, "csv", ("label", "range", "test", "scale"))
    scale = opts.get("scale", "")
    if scale and scale not in CSV_SCALES:
        raise DataError(f"csv option scale={scale}: use scale=column (standardise each column) or scale=pixels")
    if scale == "column" and "range" in opts:
        raise DataError("csv: scale=column and range=LO:HI exclude each other; give one")
    return path, opts, scale


def csv_scaling(arg: str) -> dict[str, Any] | None:
    """The per-column standardisation a ``csv:`` spec trains with (fitted on its training file), or None where
    its features are taken as they are (pixels, or a fixed ``range``): what predict must apply to new rows."""
    path, opts, scale = _csv_options(arg)
    if "range" in opts or scale == "pixels":
        return None
    columns, features, _ = _read_csv_split(path, opts.get("label", "label"))
    if not scale and _looks_like_pixels(features):
        return None
    return _fit_scaling(features, columns)


def read_csv(
    arg: str, in_shape: tuple[int, ...] | None, *, class_names: Sequence[str] | None = None
) -> tuple[Arrays, str]:
    """The npz layout from ``FILE[,label=COL][,range=LO:HI][,test=FILE][,scale=column|pixels]`` (module
    docstring); `class_names`: the federation's (a label column of names is matched with them)."""
    path, opts, scale = _csv_options(arg)
    label = opts.get("label", "label")
    lo_hi = csv_range(opts)
    columns, features, cells = _read_csv_split(path, label)
    y = _csv_labels(cells, path, label, class_names)
    splits = {"x": (features, y)}
    if "test" in opts:
        test_path = Path(opts["test"])
        test_columns, test_features, test_cells = _read_csv_split(test_path, label)
        if test_columns != columns:
            raise DataError(
                f"csv test file {test_path}: its feature columns differ from {path}'s "
                f"({test_columns[:6]} vs {columns[:6]}); give both files the same header"
            )
        splits["x_test"] = (test_features, _csv_labels(test_cells, test_path, label, class_names))
    shape = _csv_shape(features.shape[1], in_shape, path)
    scaling = None
    if lo_hi is None and (scale == "column" or (not scale and not _looks_like_pixels(features))):
        scaling = _fit_scaling(features, columns)  # fitted on the training file alone
    arrays: Arrays = {}
    for key, (v, labels) in splits.items():
        if not np.all(np.isfinite(v)):
            raise DataError(f"csv {path}: features contain NaN or inf")
        x = csv_scale(v, scaling) if scaling is not None else _csv_pixels(v, lo_hi, path)
        arrays[key] = x.reshape((len(v), *shape))
        arrays["y" if key == "x" else "y_test"] = labels
    how = (
        "each column standardised on the training file"
        if scaling is not None
        else f"range {lo_hi[0]:g}:{lo_hi[1]:g}"
        if lo_hi is not None
        else "as pixel values"
    )
    test_text = f" + {len(arrays['x_test'])} test rows of {opts['test']}" if "test" in opts else ""
    log.info("csv %s: loaded %d rows of %d features%s, %s", path, len(y), len(columns), test_text, how)
    return arrays, path.stem


# ---------------------------------------------------------------------------------------------------
# package.module:function
# ---------------------------------------------------------------------------------------------------


def read_loader(
    spec: str, in_shape: tuple[int, ...] | None, *, num_classes: int | None = None, seed: int = 0
) -> tuple[Arrays, str]:
    """Data from a loader function of one's own, ``package.module:function`` (importable: on PYTHONPATH).

    The contract: the function is called with the keyword arguments among ``in_shape`` (the federation's
    (channels, height, width), or None where the data decides), ``num_classes`` (the federation's, or
    None) and ``seed`` that it declares (all three if it takes ``**kwargs``; none if it takes none), and
    returns a tuple ``(x, y)`` or ``(x, y, x_test, y_test)`` of numpy arrays: images (n, h, w),
    (n, c, h, w) or (n, h, w, c) as uint8, integers in [0, 255] or floats in [0, 1], and integer labels
    in [0, num_classes). Given a test split it is the device's own; without one 25 % is held out on a
    device (20 % in a simulation). Images must already be of the federation's in_shape.
    """
    module_name, _, func_name = spec.strip().partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise DataError(
            f"loader {spec}: cannot import {module_name} ({e}); a loader spec is "
            "package.module:function and the module must be importable (PYTHONPATH)"
        ) from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise DataError(f"loader {spec}: {module_name} has no function {func_name}")
    offered: dict[str, Any] = {
        "in_shape": None if in_shape is None else tuple(in_shape),
        "num_classes": num_classes,
        "seed": seed,
    }
    params = inspect.signature(func).parameters
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values()):
        kwargs = offered
    else:
        kwargs = {k: v for k, v in offered.items() if k in params}
    result = func(**kwargs)
    if not isinstance(result, (tuple, list)) or len(result) not in (2, 4):
        raise DataError(
            f"loader {spec}: must return (x, y) or (x, y, x_test, y_test), got "
            f"{type(result).__name__}{f' of {len(result)}' if isinstance(result, (tuple, list)) else ''}"
        )
    keys = ("x", "y", "x_test", "y_test")[: len(result)]
    return {k: np.asarray(v) for k, v in zip(keys, result, strict=True)}, func_name
