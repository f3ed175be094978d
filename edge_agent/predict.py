"""`protofl-edge predict`: classify images by nearest prototype with an ONNX features model.

The device needs only onnxruntime, the exported features graph (``protofl-export onnx --what
features``) and a prototype table: an ``.npz`` with ``classes`` (C,) ints and ``prototypes`` (C, m)
float32, loaded without pickle. ``--fit`` builds that table from the data's training split through
the same model first (for trying the pipeline, or a device that holds labelled data).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import typer

from edge_agent.onnx_runtime import embed_onnx, parse_floats, read_metadata, session
from protofl.algorithms.fedproto import local_prototypes, nearest_prototype
from protofl.data import load_images
from protofl.errors import DataError, ProtoFLError
from protofl.requirements import explain_missing

__all__ = ["load_prototypes", "predict_command", "save_prototypes"]


def save_prototypes(path: str | os.PathLike[str], protos: dict[int, np.ndarray]) -> Path:
    """Write a prototype table as ``classes`` + ``prototypes`` arrays."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    classes = np.array(sorted(protos), dtype=np.int64)
    values = np.stack([np.asarray(protos[int(c)], dtype=np.float32) for c in classes]) if len(classes) else \
        np.zeros((0, 0), dtype=np.float32)
    with p.open("wb") as fh:  # a file handle: np.savez would append ".npz" to a name without it
        np.savez(fh, classes=classes, prototypes=values)
    return p


def load_prototypes(path: str | os.PathLike[str]) -> dict[int, np.ndarray]:
    """Read a table written by :func:`save_prototypes` (or any npz with those two arrays)."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"prototype table {p} does not exist; pass --fit to build it from the training split, "
                        "or point --prototypes at an .npz with 'classes' and 'prototypes'")
    try:
        with np.load(p, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except (OSError, ValueError) as exc:
        raise DataError(f"{p}: cannot read as .npz ({exc})") from None
    if "classes" not in arrays or "prototypes" not in arrays:
        raise DataError(f"{p}: needs arrays 'classes' (C,) and 'prototypes' (C, m); found {sorted(arrays)}")
    classes, values = arrays["classes"], arrays["prototypes"]
    if classes.ndim != 1 or values.ndim != 2 or len(classes) != len(values) or len(classes) == 0:
        raise DataError(f"{p}: 'classes' must be (C,) and 'prototypes' (C, m) with C >= 1, got "
                        f"{classes.shape} and {values.shape}")
    if not np.issubdtype(classes.dtype, np.integer) or not np.isfinite(values).all():
        raise DataError(f"{p}: classes must be integers and prototypes finite")
    return {int(c): values[i].astype(np.float32) for i, c in enumerate(classes)}


def _unit(a: np.ndarray) -> np.ndarray:
    return a / np.maximum(np.linalg.norm(a, axis=-1, keepdims=True), 1e-12)


def _run(model: Path, prototypes: Path, data: str, split: str, limit: int | None, fit: bool, fit_limit: int,
         metric: str, out: Path | None, show: int, threads: int | None) -> None:
    if metric not in ("l2", "cosine"):
        raise DataError(f"--metric must be 'l2' or 'cosine', got {metric!r}")
    meta = read_metadata(model)
    in_shape = tuple(int(v) for v in meta["in_shape"].split(",")) if meta.get("in_shape") else None
    norm = dict(in_shape=in_shape, mean=parse_floats(meta.get("norm_mean")), std=parse_floats(meta.get("norm_std")))
    sess = session(model, threads)
    if fit:
        x_tr, y_tr, ds = load_images(data, "train", fit_limit, **norm)
        z_tr = embed_onnx(sess, x_tr)
        protos, _ = local_prototypes(_unit(z_tr) if metric == "cosine" else z_tr, y_tr, ds.num_classes)
        save_prototypes(prototypes, protos)
        typer.echo(f"wrote {len(protos)} prototypes ({z_tr.shape[1]} dims, from {len(y_tr)} {data} training "
                   f"images) to {prototypes}")
    table = load_prototypes(prototypes)
    x, y, _ = load_images(data, split, limit, **norm)
    z = embed_onnx(sess, x)
    dim = next(iter(table.values())).shape[0]
    if z.shape[1] != dim:
        raise DataError(f"{model} outputs {z.shape[1]} dims but the prototypes in {prototypes} have {dim}: "
                        "use the features model the prototypes were computed with")
    if metric == "cosine":
        z, table = _unit(z), {c: _unit(v) for c, v in table.items()}
    pred = nearest_prototype(z, table)
    acc = float((pred == y).mean()) if len(y) else 0.0
    typer.echo(f"{model.name}: {len(y)} {data} {split} images, nearest prototype ({metric}) over "
               f"{len(table)} classes: accuracy {100 * acc:.2f}% ({int((pred == y).sum())}/{len(y)})")
    for i in range(min(show, len(y))):
        typer.echo(f"  #{i}: predicted {int(pred[i])}, label {int(y[i])}")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        rows = "\n".join(f"{i},{int(p)},{int(t)}" for i, (p, t) in enumerate(zip(pred, y)))
        out.write_text("index,predicted,label\n" + rows + ("\n" if rows else ""))
        typer.echo(f"wrote predictions to {out}")


def predict_command(
    model: Path = typer.Option(..., "--model", help="Features ONNX from `protofl-export onnx --what features`."),
    prototypes: Path = typer.Option(..., "--prototypes", help="Prototype table .npz (classes, prototypes)."),
    data: str = typer.Option("fashion-mnist", "--data", help="Images: fashion-mnist, npz:PATH or idx:DIR."),
    split: str = typer.Option("test", help="Which split of --data to classify: test or train."),
    limit: int | None = typer.Option(None, help="Classify a seeded random subset of this many images."),
    fit: bool = typer.Option(False, "--fit", help="First build --prototypes from the training split."),
    fit_limit: int = typer.Option(10000, help="Training images used by --fit."),
    metric: str = typer.Option("l2", help="l2 (mean prototypes) or cosine (unit prototypes)."),
    out: Path | None = typer.Option(None, "--out", help="Write index,predicted,label rows to this CSV."),
    show: int = typer.Option(10, help="Print the first N predictions."),
    threads: int | None = typer.Option(None, help="onnxruntime intra-op threads (default: all cores)."),
) -> None:
    """Classify images by nearest prototype on onnxruntime and print the accuracy."""
    try:
        with explain_missing("protofl-edge predict"):
            _run(model, prototypes, data, split, limit, fit, fit_limit, metric, out, show, threads)
    except ProtoFLError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
