"""`protofl-edge predict`: label data with an exported model, on onnxruntime alone (no torch).

The device needs only onnxruntime, the exported graph and, for a features graph, a prototype table:
an ``.npz`` with ``classes`` (C,) ints and ``prototypes`` (C, m) float32 (protofl/artifacts.py; loaded
without pickle), optionally with the ``metric`` to compare by and the ``class_names``. A model exported
``--from`` a run's artifact names the table written beside it, so ``--prototypes`` can be left out; a
``logits`` graph (a federation's global predictor) classifies by its own argmax and needs none.

* ``--input SPEC`` labels data without labels (npz, image folder, CSV, a path: protofl/data/unlabelled.py); where
  every image sits in a class folder that names one of the model's classes, it also says the accuracy;
* ``--data SPEC`` scores a labelled dataset's split (an image folder's class folders, a CSV's label names are
  labelled by the class names of the model's table or metadata, not by their sorted order);
* ``--out FILE`` writes one line per sample -- its index or file name, the class, the class name and the
  distance to the nearest prototype (L2; 1 - cosine for ``cosine``), or the class's softmax score (the probability
  the graph gives the class it picked, 0-1) for a logits graph -- as CSV, or JSON Lines for ``.jsonl``/``.json``
  (or ``--format``);
* ``--fit`` builds the table from the data's training split through the same model first.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import typer

from edge_agent.inference.onnx_runtime import embed_onnx, parse_floats, read_metadata, session
from protofl.algorithms.prototypes import local_prototypes
from protofl.artifacts import METRICS, PrototypeFile, read_prototypes, write_prototypes
from protofl.data import load_images
from protofl.errors import ConfigError, DataError, ProtoFLError
from protofl.requirements import explain_missing

if TYPE_CHECKING:  # onnxruntime is optional at import time
    from onnxruntime import InferenceSession

__all__ = ["Labels", "classify", "load_prototypes", "predict_command", "save_prototypes"]

FORMATS = ("csv", "jsonl")
T = TypeVar("T")


def save_prototypes(path: str | os.PathLike[str], protos: dict[int, np.ndarray], metric: str | None = None) -> Path:
    """Write a prototype table as ``classes`` + ``prototypes`` arrays (and its metric)."""
    return write_prototypes(path, protos, metric=metric)


def load_prototypes(path: str | os.PathLike[str]) -> dict[int, np.ndarray]:
    """Read a table written by :func:`save_prototypes` (or any npz with those two arrays)."""
    return read_prototypes(path).table()


def _unit(a: np.ndarray) -> np.ndarray:
    return a / np.maximum(np.linalg.norm(a, axis=-1, keepdims=True), 1e-12)


@dataclass(frozen=True)
class Labels:
    classes: np.ndarray  # (n,) int64
    values: np.ndarray  # (n,) float: distance to the nearest prototype, or the class's score
    value_name: str  # "distance" | "score"


def classify(z: np.ndarray, table: PrototypeFile, metric: str) -> Labels:
    """The nearest prototype to each row of `z`: L2, or cosine (then distance = 1 - cosine similarity).
    Ties go to the lower class id, as protofl.algorithms.fedproto.nearest_prototype."""
    if z.shape[1] != table.values.shape[1]:
        raise DataError(
            f"the model outputs {z.shape[1]} values but the prototypes have {table.values.shape[1]}: "
            "use the prototype table exported with this model"
        )
    order = np.argsort(table.classes, kind="stable")
    classes, protos = table.classes[order], table.values[order].astype(np.float64)
    z64 = z.astype(np.float64)
    if metric == "cosine":
        sim = _unit(z64) @ _unit(protos).T
        best = np.argmax(sim, axis=1)
        dist = 1.0 - sim[np.arange(len(z64)), best]
    else:
        d2 = (protos * protos).sum(axis=1)[None, :] - 2.0 * (z64 @ protos.T)
        best = np.argmin(d2, axis=1)
        dist = np.sqrt(np.maximum(d2[np.arange(len(z64)), best] + (z64 * z64).sum(axis=1), 0.0))
    return Labels(classes[best] if len(z64) else np.zeros(0, np.int64), dist, "distance")


def _argmax(logits: np.ndarray) -> Labels:
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    p = e / e.sum(axis=1, keepdims=True)
    best = p.argmax(axis=1)
    return Labels(best.astype(np.int64), p[np.arange(len(p)), best], "score")


def write_labels(
    out: Path,
    fmt: str | None,
    names: list[str],
    labels: Labels,
    class_name: dict[int, str],
    truth: np.ndarray | None = None,
) -> None:
    """One line per sample, as CSV or JSON Lines (module docstring)."""
    fmt = fmt or ("jsonl" if out.suffix.lower() in (".jsonl", ".json", ".ndjson") else "csv")
    if fmt not in FORMATS:
        raise DataError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    keys = ["sample", "class", "class_name", labels.value_name] + (["label"] if truth is not None else [])
    triples = zip(names, labels.classes, labels.values, strict=True)
    rows = (
        [n, int(c), class_name.get(int(c), str(int(c))), round(float(v), 6)]
        + ([int(truth[i])] if truth is not None else [])
        for i, (n, c, v) in enumerate(triples)
    )
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("w", newline="") as fh:
            if fmt == "csv":
                w = csv.writer(fh)
                w.writerow(keys)
                w.writerows(rows)
            else:
                for r in rows:
                    fh.write(json.dumps(dict(zip(keys, r, strict=True))) + "\n")
    except OSError as exc:
        raise DataError(
            f"--out {out}: cannot write the labels ({exc.strerror or exc}); give a file in a folder you can write, "
            "on a disk with room"
        ) from None


@dataclass
class _Model:
    """An exported graph and what its metadata says about it."""

    path: Path
    meta: dict[str, str]

    def _read(self, key: str, parse: Callable[[str], T]) -> T | None:
        """A metadata value parsed, or a ConfigError naming the key (a crafted or damaged file)."""
        text = self.meta.get(key)
        if not text:
            return None
        try:
            return parse(text)
        except (ValueError, TypeError) as exc:
            raise ConfigError(
                f"{self.path}: its metadata {key}={text[:80]!r} does not read ({exc}); export it again with "
                "protofl-export onnx"
            ) from None

    @property
    def in_shape(self) -> tuple[int, int, int] | None:
        shape = self._read("in_shape", lambda s: tuple(int(v) for v in s.split(",")))
        if shape is not None and (len(shape) != 3 or min(shape) < 1):
            raise ConfigError(f"{self.path}: its metadata in_shape {shape} is not (channels, height, width)")
        return shape

    @property
    def mean(self) -> tuple[float, ...] | None:
        return self._read("norm_mean", lambda s: parse_floats(s) or ())

    @property
    def std(self) -> tuple[float, ...] | None:
        return self._read("norm_std", lambda s: parse_floats(s) or ())

    def check(self) -> None:
        """The metadata agree with each other: a normalisation per channel of in_shape (else a ConfigError)."""
        shape = self.in_shape
        for key, values in (("norm_mean", self.mean), ("norm_std", self.std)):
            if shape is not None and values and len(values) != shape[0] or values == ():
                raise ConfigError(
                    f"{self.path}: its metadata {key} has {len(values or ())} values for in_shape {shape}: one per "
                    "channel; export it again with protofl-export onnx"
                )

    @property
    def logits(self) -> bool:
        return self.meta.get("what") == "logits"

    def class_names(self, table: PrototypeFile | None) -> dict[int, str]:
        if table is not None and table.class_names is not None:
            return {int(c): n for c, n in zip(table.classes, table.class_names, strict=True)}
        names = self._read("class_names", json.loads) or []
        if not isinstance(names, list):
            raise ConfigError(f"{self.path}: its metadata class_names is not a list; export it again")
        return {i: str(n) for i, n in enumerate(names)}

    def named_classes(self, table: PrototypeFile | None) -> list[str] | None:
        """The model's class names by class id, where it names its classes (not only by their ids): what a
        labelled image folder's class folders are matched with (None: they are read as before)."""
        names = self.class_names(table)
        if not names or all(n == str(c) for c, n in names.items()):
            return None
        return [names.get(i, str(i)) for i in range(max(names) + 1)]

    def default_prototypes(self) -> Path | None:
        name = self.meta.get("prototypes")
        return None if not name else (Path(name) if Path(name).is_absolute() else self.path.parent / name)


def _labels(model: _Model, sess: InferenceSession, x: np.ndarray, table: PrototypeFile | None, metric: str) -> Labels:
    out = embed_onnx(sess, x)
    if table is None:  # a logits graph
        return _argmax(out)
    return classify(out, table, metric)


def _fit(
    model: _Model, sess: InferenceSession, data: str, fit_limit: int, metric: str | None, table_path: Path | None
) -> None:
    """--fit: a prototype table from the labelled training split of `data`, through the same graph."""
    if model.logits:
        raise DataError("--fit builds prototypes for a features graph; this one is a classifier (logits)")
    if table_path is None:
        raise DataError("--fit needs --prototypes FILE: where to write the table it builds")
    x_tr, y_tr, ds = load_images(data, "train", fit_limit, in_shape=model.in_shape, mean=model.mean, std=model.std)
    z_tr = embed_onnx(sess, x_tr)
    protos, _ = local_prototypes(_unit(z_tr) if metric == "cosine" else z_tr, y_tr, ds.num_classes)
    write_prototypes(table_path, protos, metric=metric or "l2")
    typer.echo(
        f"wrote {len(protos)} prototypes ({z_tr.shape[1]} dims, from {len(y_tr)} {data} training "
        f"images) to {table_path}"
    )


def _label_input(
    model: _Model,
    sess: InferenceSession,
    input_: str,
    table: PrototypeFile | None,
    metric: str,
    how: str,
    out: Path | None,
    fmt: str | None,
    show: int,
) -> None:
    """--input: label data without labels, one line per sample to --out."""
    from protofl.data.unlabelled import load_unlabelled

    if model.in_shape is None:
        raise DataError(f"{model.path} records no input shape; re-export it with protofl-export onnx")
    scaling = model._read("csv_scaling", json.loads)
    batch = load_unlabelled(input_, model.in_shape, scaling)
    labels = _labels(model, sess, batch.normalized(model.mean, model.std), table, metric)
    names = model.class_names(table)
    typer.echo(f"{model.path.name}: labelled {len(batch.names)} samples of {input_} by {how}")
    if batch.skipped:
        typer.echo(f"skipped {len(batch.skipped)} file(s) that could not be read (not labelled):")
        for name, reason in batch.skipped:
            typer.echo(f"  {name}: {reason}")
    for i in range(min(show, len(batch.names))):
        c = int(labels.classes[i])
        typer.echo(f"  {batch.names[i]}: {c} ({names.get(c, c)}), {labels.value_name} {labels.values[i]:.4g}")
    truth = folder_labels(batch.names, model.named_classes(table) or [names[c] for c in sorted(names)])
    if truth is not None:
        right = int((labels.classes == truth).sum())
        typer.echo(
            f"accuracy {100 * right / max(len(truth), 1):.2f}% ({right}/{len(truth)}): every image is in a class "
            "folder named after one of the model's classes"
        )
    if out is not None:
        write_labels(out, fmt, batch.names, labels, names, truth=truth)
        typer.echo(f"wrote {len(batch.names)} labels to {out}")


def folder_labels(samples: list[str], classes: list[str]) -> np.ndarray | None:
    """The class ids that the folders of an image folder's samples (named `folder/file`, relative to it) say,
    matched with the model's class names as join matches class folders (case, spaces, punctuation ignored; a
    number is the id); None unless every sample is in a folder that names one of `classes`."""
    from protofl.data.own import label_map

    folders = [name.split("/", 1)[0] if "/" in name else None for name in samples]
    if not samples or not classes or any(f is None for f in folders):
        return None
    try:
        ids = label_map(sorted(set(folders)), classes, "--input", "class folder(s)")  # type: ignore[arg-type]
    except DataError:
        return None
    return np.array([ids[f] for f in folders if f is not None], dtype=np.int64)


def _score(
    model: _Model,
    sess: InferenceSession,
    data: str,
    split: str,
    limit: int | None,
    table: PrototypeFile | None,
    metric: str,
    how: str,
    out: Path | None,
    fmt: str | None,
    show: int,
) -> None:
    """--data: classify a labelled split and say the accuracy (class folders labelled by the model's class names)."""
    x, y, _ = load_images(
        data,
        split,
        limit,
        in_shape=model.in_shape,
        mean=model.mean,
        std=model.std,
        class_names=model.named_classes(table),
    )
    labels = _labels(model, sess, x, table, metric)
    pred = labels.classes
    acc = float((pred == y).mean()) if len(y) else 0.0
    typer.echo(
        f"{model.path.name}: {len(y)} {data} {split} images, {how}: accuracy {100 * acc:.2f}% "
        f"({int((pred == y).sum())}/{len(y)})"
    )
    for i in range(min(show, len(y))):
        typer.echo(f"  #{i}: predicted {int(pred[i])}, label {int(y[i])}")
    if out is not None:
        write_labels(out, fmt, [str(i) for i in range(len(y))], labels, model.class_names(table), truth=y)
        typer.echo(f"wrote predictions to {out}")


def _run(
    model_path: Path,
    prototypes: Path | None,
    data: str,
    input_: str | None,
    split: str,
    limit: int | None,
    fit: bool,
    fit_limit: int,
    metric: str | None,
    out: Path | None,
    fmt: str | None,
    show: int,
    threads: int | None,
) -> None:
    if metric is not None and metric not in METRICS:
        raise DataError(f"--metric must be 'l2' or 'cosine', got {metric!r}")
    model = _Model(model_path, read_metadata(model_path))
    model.check()
    sess = session(model_path, threads)
    table_path = prototypes or model.default_prototypes()
    if fit:
        _fit(model, sess, data, fit_limit, metric, table_path)
    table = None
    if not model.logits:
        if table_path is None:
            raise DataError(
                f"{model_path} is a features graph: pass --prototypes FILE (protofl-export onnx --from "
                "ARTIFACT writes one beside the model), or --fit to build one from labelled data"
            )
        table = read_prototypes(table_path)
    used = metric or (table.metric if table is not None else None) or model.meta.get("metric") or "l2"
    how = (
        "the argmax of its logits" if table is None else f"nearest prototype ({used}) over {len(table.classes)} classes"
    )
    if input_ is not None:
        _label_input(model, sess, input_, table, used, how, out, fmt, show)
    else:
        _score(model, sess, data, split, limit, table, used, how, out, fmt, show)


def predict_command(
    model: Path = typer.Option(..., "--model", help="ONNX from protofl-export onnx (features, or logits)."),
    prototypes: Path | None = typer.Option(
        None,
        "--prototypes",
        help="Prototype table .npz (classes, prototypes); "
        "default: the one the model names (exported --from an artifact).",
    ),
    input_: str | None = typer.Option(
        None,
        "--input",
        help="Data to label, without labels: npz:PATH (array x), "
        "imagefolder:DIR (every image under it), csv:FILE[,name=COL], or a path.",
    ),
    data: str = typer.Option(
        "fashion-mnist",
        "--data",
        help="Labelled data to score: fashion-mnist, npz:PATH, idx:DIR, ... (ignored with --input).",
    ),
    split: str = typer.Option("test", help="Which split of --data to classify: test or train."),
    limit: int | None = typer.Option(None, help="Classify a seeded random subset of this many images of --data."),
    fit: bool = typer.Option(False, "--fit", help="First build --prototypes from the training split of --data."),
    fit_limit: int = typer.Option(10000, help="Training images used by --fit."),
    metric: str | None = typer.Option(
        None, help="l2 (mean prototypes) or cosine (unit prototypes); default: the table's own, else l2."
    ),
    out: Path | None = typer.Option(
        None,
        "--out",
        help="Write one line per sample here: sample, class, class_name, then distance (a features graph: to the "
        "nearest prototype, L2 or 1 - cosine; lower is closer) or score (a logits graph: the softmax probability "
        "0-1 of the class it picked; higher is surer), and label where --input's class folders name the classes: "
        "CSV, or JSON Lines for .jsonl.",
    ),
    fmt: str | None = typer.Option(None, "--format", help="csv or jsonl (default: from --out's suffix)."),
    show: int = typer.Option(10, help="Print the first N predictions."),
    threads: int | None = typer.Option(None, help="onnxruntime intra-op threads (default: all cores)."),
) -> None:
    """Label data by nearest prototype (or a classifier's argmax) on onnxruntime, without torch."""
    try:
        with explain_missing("protofl-edge predict"):
            _run(model, prototypes, data, input_, split, limit, fit, fit_limit, metric, out, fmt, show, threads)
    except ProtoFLError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
