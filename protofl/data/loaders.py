"""The dataset loaders (IDX, npz, the dataset specs the CLIs take), producing ``Dataset``s.

A field trial's own formats (image folders, CSV, a loader function of one's own) are read by
``protofl.data.own`` into the npz layout and finished here like an npz.

numpy only (this package must not import torch). ``Dataset`` itself lives in ``protofl.data.dataset``
and is re-exported here.
"""

from __future__ import annotations

import gzip
import io
import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from protofl.data import own
from protofl.data.dataset import Dataset, channel_stats
from protofl.data.synthetic import make_synthetic
from protofl.errors import DataError

__all__ = [
    "DATASET_SPECS",
    "check_source",
    "FASHION_MNIST_DIR",
    "FASHION_MNIST_MEAN",
    "FASHION_MNIST_STD",
    "Dataset",
    "load_dataset",
    "load_fashion_mnist",
    "load_idx_dir",
    "from_arrays",
    "load_npz",
    "load_source",
    "read_idx",
]

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_MEAN: tuple[float, ...] = (0.2860,)
FASHION_MNIST_STD: tuple[float, ...] = (0.3530,)

DATASET_SPECS = (
    "fashion-mnist",
    "synthetic",
    "synthetic:n=2000,classes=10,size=28",
    "npz:PATH",
    "idx:DIR",
    "imagefolder:DIR[,classes=FILE][,strict=true]",
    "csv:FILE[,label=COL][,range=LO:HI][,test=FILE][,scale=column|pixels]",
    "package.module:function",
)


# ---------------------------------------------------------------------------------------------------
# IDX (the MNIST / Fashion-MNIST file format)
# ---------------------------------------------------------------------------------------------------

# IDX type codes -> big-endian numpy dtypes (http://yann.lecun.com/exdb/mnist/, "THE IDX FILE FORMAT").
_IDX_DTYPES: dict[int, str] = {
    0x08: ">u1",
    0x09: ">i1",
    0x0B: ">i2",
    0x0C: ">i4",
    0x0D: ">f4",
    0x0E: ">f8",
}


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Read an IDX file (optionally gzip-compressed; detected from its bytes, not its name).

    Header: two zero bytes, a type code, the number of dimensions, then one big-endian uint32 per
    dimension. The payload must be exactly prod(dims) * itemsize bytes. Returns a native-endian array.
    """
    p = Path(path)
    try:
        with open(p, "rb") as plain:
            gz = plain.read(2) == b"\x1f\x8b"  # gzip magic
            plain.seek(0)
            f: io.BufferedIOBase = gzip.GzipFile(fileobj=plain) if gz else plain
            try:
                return _read_idx_stream(f, p)
            except (OSError, EOFError, gzip.BadGzipFile) as e:
                if gz and not isinstance(e, FileNotFoundError):
                    raise DataError(f"{p}: corrupt gzip stream ({e})") from None
                raise
    except DataError:
        raise
    except OSError as e:
        raise DataError(f"{p}: cannot read IDX file ({e.strerror or e})") from None


def _read_idx_stream(f: io.BufferedIOBase, p: Path) -> np.ndarray:
    """`read_idx` on an open (decompressing) stream: the payload is read straight into the array it becomes, so
    a device holds the images once while it loads them, not the file, its decompressed bytes and a copy."""
    head = f.read(4)
    if len(head) < 4:
        raise DataError(f"{p}: not an IDX file (only {len(head)} bytes, the header alone is 4+)")
    if head[0] != 0 or head[1] != 0:
        raise DataError(f"{p}: not an IDX file (bad magic {head[:4].hex()}; expected 0000<type><ndim>)")
    code, ndim = head[2], head[3]
    if code not in _IDX_DTYPES:
        raise DataError(f"{p}: unknown IDX data type code 0x{code:02x} (known: 08, 09, 0b, 0c, 0d, 0e)")
    if ndim == 0:
        raise DataError(f"{p}: IDX header declares 0 dimensions")
    header = 4 + 4 * ndim
    raw_dims = f.read(4 * ndim)
    if len(raw_dims) < 4 * ndim:
        raise DataError(f"{p}: truncated IDX header ({4 + len(raw_dims)} bytes, expected {header} for {ndim} dims)")
    dims = tuple(int(v) for v in np.frombuffer(raw_dims, dtype=">u4", count=ndim))
    dtype = np.dtype(_IDX_DTYPES[code])
    # Python ints: a hostile header cannot overflow this product, and the buffer below grows only as far as the
    # payload really goes (a header claiming terabytes over a small file is refused, not allocated).
    expected = math.prod(dims) * dtype.itemsize
    # Read into one buffer that grows only as far as the payload really goes (64 MiB first: Fashion-MNIST's
    # training images, 47 MB, in one piece).
    buf = bytearray(min(expected, 1 << 26))
    pos = 0
    while pos < expected:
        if pos == len(buf):
            buf.extend(bytes(min(len(buf), expected - len(buf))))
        # 4 MiB at a time: a gzip stream asked for everything decompresses it all into one bytes object first.
        with memoryview(buf) as view, view[pos : pos + (1 << 22)] as rest:
            n = f.readinto(rest)
        if not n:
            break
        pos += n
    del buf[pos:]
    got = len(buf) + len(f.read(1))
    if got != expected:
        what = "truncated" if got < expected else "trailing bytes in"
        shown = got if got < expected else "more"
        raise DataError(
            f"{p}: {what} IDX payload: dims {dims} x {dtype.itemsize} bytes = {expected} bytes, got {shown}"
        )
    arr = np.frombuffer(buf, dtype=dtype).reshape(dims)  # writable: over a bytearray, no copy
    return arr if dtype.byteorder in ("=", "|") else arr.astype(dtype.newbyteorder("="))


def _find_idx(data_dir: Path, split: str, kind: str, ndim: int) -> Path:
    # The original names, with or without .gz; some mirrors use a dot before "idx".
    candidates = [
        f"{split}-{kind}-idx{ndim}-ubyte",
        f"{split}-{kind}.idx{ndim}-ubyte",
    ]
    for name in candidates:
        for suffix in ("", ".gz"):
            path = data_dir / (name + suffix)
            if path.is_file():
                return path
    raise DataError(
        f"{data_dir}: no {candidates[0]}[.gz] found; an IDX dataset directory holds "
        "train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte "
        "(each optionally .gz)"
    )


def _images_to_nchw(x: np.ndarray, where: str) -> np.ndarray:
    """(n,h,w) -> (n,1,h,w); (n,c,h,w) kept; (n,h,w,c) transposed. Channels are 1..4."""
    if x.ndim == 3:
        return x[:, None, :, :]
    if x.ndim == 4:
        first, last = x.shape[1], x.shape[3]
        # The channel axis is the one of size <= 4 (grey, RGB, RGBA). When both could be (tiny images,
        # e.g. (n, 3, 4, 4)) channels-first wins: it is the torch convention this package produces.
        if first <= 4:
            return x
        if last <= 4:
            return np.ascontiguousarray(x.transpose(0, 3, 1, 2))
    raise DataError(
        f"{where}: images must be (n, h, w), (n, c, h, w) or (n, h, w, c) with 1-4 channels, got shape {x.shape}"
    )


def _to_uint8(x: np.ndarray, where: str) -> np.ndarray:
    if x.dtype == np.uint8:
        return x
    if np.issubdtype(x.dtype, np.floating):
        if not np.all(np.isfinite(x)):
            raise DataError(f"{where}: float images contain NaN or inf")
        lo, hi = (float(x.min()), float(x.max())) if x.size else (0.0, 1.0)
        if lo < 0.0 or hi > 1.0:
            raise DataError(f"{where}: float images must be in [0, 1], got range [{lo:g}, {hi:g}]")
        return np.rint(x * 255.0).astype(np.uint8)
    if np.issubdtype(x.dtype, np.integer) and x.dtype != np.bool_:
        lo, hi = (int(x.min()), int(x.max())) if x.size else (0, 0)
        if lo < 0 or hi > 255:
            raise DataError(f"{where}: integer images must be in [0, 255], got range [{lo}, {hi}]")
        return x.astype(np.uint8)
    raise DataError(f"{where}: images must be uint8, integers in [0, 255] or floats in [0, 1], got {x.dtype}")


def _to_labels(y: np.ndarray, n: int, where: str) -> np.ndarray:
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1:
        raise DataError(f"{where}: labels must be 1-D, got shape {y.shape}")
    if not np.issubdtype(y.dtype, np.integer) or y.dtype == np.bool_:
        raise DataError(f"{where}: labels must be integers, got dtype {y.dtype}")
    if len(y) != n:
        raise DataError(f"{where}: {len(y)} labels for {n} images")
    if len(y) and int(y.min()) < 0:
        raise DataError(f"{where}: labels must be >= 0, found {int(y.min())}")
    return y.astype(np.int64)


def _num_classes(where: str, *labels: np.ndarray, declared: int | None = None) -> int:
    top = max((int(y.max()) for y in labels if len(y)), default=-1)
    if declared is None:
        return top + 1
    if top >= declared:
        raise DataError(
            f"{where}: label {top} out of range for {declared} classes: the federation expects "
            f"{declared} classes (labels 0..{declared - 1}); a device may hold any subset of them"
        )
    return declared


def _check_shape(where: str, have: tuple[int, ...], in_shape: tuple[int, ...] | None) -> None:
    if in_shape is not None and tuple(have) != tuple(in_shape):
        c, h, w = in_shape
        raise DataError(
            f"{where}: images are {tuple(have)} (channels, height, width) but the federation expects "
            f"in_shape {tuple(in_shape)}: {c} channel(s) of {h}x{w}; bring data of that shape "
            f"(imagefolder: and csv: adapt to it; arrays are not resized)"
        )


def load_idx_dir(
    data_dir: str | os.PathLike[str],
    name: str,
    num_classes: int | None = None,
    mean: tuple[float, ...] | None = None,
    std: tuple[float, ...] | None = None,
) -> tuple[Dataset, Dataset]:
    """(train, test) from a directory in the MNIST 4-file IDX layout.

    ``num_classes`` defaults to max label + 1; mean/std default to the training images' statistics.
    """
    d = Path(data_dir)
    if not d.is_dir():
        raise DataError(f"IDX dataset directory {d} does not exist")
    xs: dict[str, np.ndarray] = {}
    ys: dict[str, np.ndarray] = {}
    for split in ("train", "t10k"):
        img_path = _find_idx(d, split, "images", 3)
        lab_path = _find_idx(d, split, "labels", 1)
        x = read_idx(img_path)
        xs[split] = _to_uint8(_images_to_nchw(x, str(img_path)), str(img_path))
        ys[split] = _to_labels(read_idx(lab_path), len(x), str(lab_path))
    k = _num_classes(str(d), ys["train"], ys["t10k"], declared=num_classes)
    if mean is None or std is None:
        mean, std = channel_stats(xs["train"])
    train = Dataset(xs["train"], ys["train"], k, name, mean, std)
    test = Dataset(xs["t10k"], ys["t10k"], k, name, mean, std)
    if train.in_shape != test.in_shape:
        raise DataError(f"{d}: train images are {train.in_shape} but test images are {test.in_shape}")
    return train, test


def load_fashion_mnist(data_dir: str | os.PathLike[str] | None = None) -> tuple[Dataset, Dataset]:
    """Fashion-MNIST (train 60000, test 10000, 1x28x28, 10 classes) from the IDX files."""
    d = Path(data_dir if data_dir is not None else FASHION_MNIST_DIR)
    if not d.is_dir():
        raise DataError(
            f"Fashion-MNIST not found: {d} does not exist. Install it with "
            "`apt-get install dataset-fashion-mnist`, or pass --data-dir DIR pointing at a directory with "
            "train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz], t10k-images-idx3-ubyte[.gz] "
            "and t10k-labels-idx1-ubyte[.gz]"
        )
    return load_idx_dir(d, "fashion-mnist", 10, FASHION_MNIST_MEAN, FASHION_MNIST_STD)


# ---------------------------------------------------------------------------------------------------
# npz
# ---------------------------------------------------------------------------------------------------


def load_npz(
    path: str | os.PathLike[str],
    seed: int = 0,
    name: str | None = None,
    *,
    holdout: float | None = 0.2,
    num_classes: int | None = None,
    in_shape: tuple[int, ...] | None = None,
) -> tuple[Dataset, Dataset]:
    """(train, test) from an .npz with ``x``, ``y`` and optionally ``x_test``, ``y_test``.

    Without a test split, a seeded random ``holdout`` share of (x, y) becomes the test split (80/20 by
    default). Optional entries: ``num_classes`` (scalar; otherwise max label + 1), ``mean`` and ``std``
    (per channel, [0, 1] units; otherwise computed from the training images). Images may be (n,h,w),
    (n,c,h,w) or (n,h,w,c), as uint8, integers in [0, 255] or floats in [0, 1]. Loaded with
    ``allow_pickle=False``: an npz is data, not code. ``num_classes``/``in_shape`` given (the federation's):
    labels must lie in [0, num_classes) and images must be of that shape.
    """
    train, test = _npz(path, seed, name, holdout=holdout, num_classes=num_classes, in_shape=in_shape)
    if test is None:  # holdout=None and no test split in the file
        raise DataError(f"{path}: no x_test/y_test and no holdout to make one")
    return train, test


def read_npz(path: Path, what: str = "npz dataset") -> dict[str, np.ndarray]:
    """Every array of an .npz, loaded without pickle (an npz is data, not code)."""
    try:
        with np.load(path, allow_pickle=False) as f:
            return {k: f[k] for k in f.files}
    except FileNotFoundError:
        raise DataError(f"{what} not found: {path} does not exist") from None
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: cannot read as .npz ({e})") from None


def _npz(
    path: str | os.PathLike[str],
    seed: int,
    name: str | None,
    *,
    holdout: float | None,
    num_classes: int | None,
    in_shape: tuple[int, ...] | None,
) -> tuple[Dataset, Dataset | None]:
    p = Path(path)
    arrays = read_npz(p)
    return from_arrays(
        arrays,
        str(p),
        name if name is not None else p.stem,
        seed,
        holdout=holdout,
        num_classes=num_classes,
        in_shape=in_shape,
    )


def from_arrays(
    arrays: dict[str, np.ndarray],
    where: str,
    name: str,
    seed: int = 0,
    *,
    holdout: float | None = 0.2,
    num_classes: int | None = None,
    in_shape: tuple[int, ...] | None = None,
    nchw: bool = False,
) -> tuple[Dataset, Dataset | None]:
    """(train, test) from the npz layout (``x``, ``y``, optional ``x_test``/``y_test``, ``num_classes``,
    ``mean``/``std``), whatever read it. Without a test split a seeded ``holdout`` share becomes one (None:
    no test split, test is None). ``nchw``: the images are already (n, c, h, w) (no layout guess)."""
    missing = [k for k in ("x", "y") if k not in arrays]
    if missing:
        raise DataError(f"{where}: missing array(s) {', '.join(missing)}; found {sorted(arrays)}")
    if ("x_test" in arrays) != ("y_test" in arrays):
        raise DataError(f"{where}: x_test and y_test must be given together")

    def images(key: str) -> np.ndarray:
        x = arrays[key] if nchw else _images_to_nchw(arrays[key], f"{where}[{key}]")
        return _to_uint8(x, f"{where}[{key}]")

    x = images("x")
    y = _to_labels(arrays["y"], len(x), f"{where}[y]")
    x_test: np.ndarray | None = None
    y_test: np.ndarray | None = None
    if "x_test" in arrays:
        x_test = images("x_test")
        y_test = _to_labels(arrays["y_test"], len(x_test), f"{where}[y_test]")
        if x_test.shape[1:] != x.shape[1:]:
            raise DataError(f"{where}: x is {x.shape[1:]} per image but x_test is {x_test.shape[1:]}")
    elif holdout is not None:
        if len(x) < 2:
            raise DataError(f"{where}: need at least 2 samples to hold out a test split, got {len(x)}")
        perm = np.random.default_rng(seed).permutation(len(x))
        n_test = min(len(x) - 1, max(1, int(round(holdout * len(x)))))
        test_idx, train_idx = np.sort(perm[:n_test]), np.sort(perm[n_test:])
        x, y, x_test, y_test = x[train_idx], y[train_idx], x[test_idx], y[test_idx]
    _check_shape(where, x.shape[1:], in_shape)
    declared = num_classes
    if "num_classes" in arrays:
        nc = arrays["num_classes"]
        if nc.ndim != 0 or not np.issubdtype(nc.dtype, np.integer) or int(nc) < 1:
            raise DataError(f"{where}: num_classes must be a positive integer scalar, got {nc!r}")
        if num_classes is not None and int(nc) != num_classes:
            raise DataError(
                f"{where}: num_classes is {int(nc)} but the federation has {num_classes} classes; "
                f"drop num_classes from the file or make it {num_classes}"
            )
        declared = int(nc)
    k = _num_classes(where, y, *(() if y_test is None else (y_test,)), declared=declared)
    if "mean" in arrays and "std" in arrays:
        mean = tuple(float(v) for v in np.ravel(arrays["mean"]))
        std = tuple(float(v) for v in np.ravel(arrays["std"]))
    else:
        mean, std = channel_stats(x)
    train = Dataset(x, y, k, name, mean, std)
    if x_test is None or y_test is None:
        return train, None
    return train, Dataset(x_test, y_test, k, name, mean, std)


# ---------------------------------------------------------------------------------------------------
# Dataset specs (what the CLIs accept after --dataset)
# ---------------------------------------------------------------------------------------------------

_SYNTHETIC_KEYS = ("n", "n_test", "classes", "size", "channels", "noise", "seed")


def _parse_synthetic(options: str, seed: int) -> tuple[Dataset, Dataset]:
    values: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in options.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in _SYNTHETIC_KEYS:
            raise DataError(f"bad synthetic option {item!r}; use key=value with keys {', '.join(_SYNTHETIC_KEYS)}")
        values[key] = value.strip()
    try:
        n = int(values.get("n", 2000))
        n_test = int(values.get("n_test", max(1, n // 4)))
        classes = int(values.get("classes", 10))
        size = int(values.get("size", 28))
        channels = int(values.get("channels", 1))
        seed = int(values.get("seed", seed))
        kwargs: dict[str, float] = {}
        if "noise" in values:
            kwargs["noise"] = float(values["noise"])
    except ValueError as e:
        raise DataError(f"bad synthetic option value in {options!r}: {e}") from None
    return make_synthetic(classes, n, n_test, (channels, size, size), seed, **kwargs)


def load_dataset(
    spec: str,
    data_dir: str | os.PathLike[str] | None = None,
    seed: int = 0,
    *,
    num_classes: int | None = None,
    in_shape: tuple[int, ...] | None = None,
    class_names: Sequence[str] | None = None,
) -> tuple[Dataset, Dataset]:
    """(train, test) for a dataset spec.

    Specs: ``fashion-mnist`` (from ``data_dir`` or FASHION_MNIST_DIR), ``synthetic`` or
    ``synthetic:n=2000,classes=10,size=28`` (also n_test, channels, noise, seed), ``npz:PATH``,
    ``idx:DIR``, ``imagefolder:DIR[,classes=FILE]``, ``csv:FILE[,label=COL][,range=LO:HI]`` and
    ``package.module:function`` (see ``protofl.data.own``). ``seed`` drives the synthetic generator and the
    80/20 split of data without a test split; ``data_dir`` only applies to fashion-mnist.

    ``num_classes``/``in_shape`` (the federation's, when it has one): the data's labels must lie in
    [0, num_classes) -- any subset of the classes will do -- and its images must be in_shape
    (channels, height, width); image folders are resized and CSV rows reshaped to it. None: the data decides.
    ``class_names`` (the federation's, where it names its classes): an image folder's class folders and a CSV's
    label names are matched with them (``protofl.data.own``); data labelled by ids is read as before.
    """
    train, test = load_source(
        spec, data_dir, seed, num_classes=num_classes, in_shape=in_shape, holdout=0.2, class_names=class_names
    )
    assert test is not None  # a holdout always makes one
    return train, test


def load_source(
    spec: str,
    data_dir: str | os.PathLike[str] | None = None,
    seed: int = 0,
    *,
    num_classes: int | None = None,
    in_shape: tuple[int, ...] | None = None,
    holdout: float | None = 0.2,
    class_names: Sequence[str] | None = None,
) -> tuple[Dataset, Dataset | None]:
    """``load_dataset`` where the data's own test split may be absent: with ``holdout=None`` the test
    split is the data's own (npz/loader ``x_test``, IDX ``t10k``, an image folder's ``test/``) or None.
    The synthetic generator's test set counts as none (it stands for an official test set, not a device's)."""
    kind, sep, arg = spec.partition(":")
    kind = kind.strip().lower()
    shape = None if in_shape is None else tuple(int(v) for v in in_shape)
    if kind in ("fashion-mnist", "fashion_mnist", "fmnist") and not sep:
        return _conform(load_fashion_mnist(data_dir), spec, num_classes, shape)
    if kind == "synthetic":
        train, test = _conform(_parse_synthetic(arg, seed), spec, num_classes, shape)
        return train, (test if holdout is not None else None)
    if kind == "npz" and arg:
        return _npz(arg, seed, None, holdout=holdout, num_classes=num_classes, in_shape=shape)
    if kind == "idx" and arg:
        return _conform(load_idx_dir(arg, Path(arg).name or "idx", num_classes), spec, num_classes, shape)
    if kind in own.KINDS and arg:
        arrays, name = own.read(kind, arg, shape, num_classes=num_classes, seed=seed, class_names=class_names)
        skipped = int(arrays.pop(own.SKIPPED_KEY, 0))
        read_train, read_test = from_arrays(
            arrays, spec, name, seed, holdout=holdout, num_classes=num_classes, in_shape=shape, nchw=True
        )
        read_train.skipped_files = skipped
        return read_train, read_test
    if own.is_loader(spec):
        arrays, name = own.read(own.LOADER, spec, shape, num_classes=num_classes, seed=seed)
        return from_arrays(arrays, spec, name, seed, holdout=holdout, num_classes=num_classes, in_shape=shape)
    raise DataError(f"unknown dataset spec {spec!r}; use one of: {', '.join(DATASET_SPECS)}")


def check_source(spec: str) -> str:
    """`spec` checked without reading its data (fast, numpy only: before torch is imported): a known kind, its
    file or folder there, its options valid. Returns `spec`; a loader function is checked when it is called."""
    kind, sep, arg = spec.partition(":")
    kind = kind.strip().lower()
    if kind in ("fashion-mnist", "fashion_mnist", "fmnist") and not sep or kind == "synthetic":
        return spec
    if own.is_loader(spec) and kind not in ("npz", "idx", *own.KINDS):
        return spec
    if kind not in ("npz", "idx", *own.KINDS) or not arg.strip():
        raise DataError(f"unknown dataset spec {spec!r}; use one of: {', '.join(DATASET_SPECS)}")
    path = Path(own.path_of(arg))
    if not path.exists():
        raise DataError(f"dataset {spec!r}: not found: {path} does not exist")
    files: list[str] = []
    if kind == "imagefolder":
        _, opts = own._options(arg, "imagefolder", ("classes", "strict"))
        own._is_strict(opts, "imagefolder")
        files = [opts["classes"]] if "classes" in opts else []
        if not path.is_dir():
            raise DataError(f"image folder not found: {path} is not a directory")
    elif kind == "csv":
        _, opts, _ = own._csv_options(arg)
        own.csv_range(opts)
        files = [opts["test"]] if "test" in opts else []
    for f in files:
        if not Path(f).is_file():
            raise DataError(f"dataset {spec!r}: not found: {f} does not exist")
    return spec


def _conform(
    pair: tuple[Dataset, Dataset], where: str, num_classes: int | None, in_shape: tuple[int, ...] | None
) -> tuple[Dataset, Dataset]:
    """A loaded (train, test) held to the federation's classes and shape (labels checked, never remapped)."""
    train, test = pair
    _check_shape(where, train.in_shape, in_shape)
    if num_classes is None or num_classes == train.num_classes and num_classes == test.num_classes:
        return train, test
    k = _num_classes(where, train.y, test.y, declared=num_classes)
    return (
        Dataset(train.x, train.y, k, train.name, train.mean, train.std),
        Dataset(test.x, test.y, k, test.name, test.mean, test.std),
    )
