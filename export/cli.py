"""`protofl-export`: ONNX export of backbones for inference-time prototype extraction.

    protofl-export onnx --from RUN/devices/ID --out features.onnx      # a device's model + its prototypes
    protofl-export onnx --from RUN/global --out new.onnx                # a new device: its model + global prototypes
    protofl-export onnx --arch cnn [--checkpoint ckpt.pt] --out features.onnx [--what features|backbone|logits]
    protofl-export verify features.onnx [--from ARTIFACT | --arch cnn --checkpoint ckpt.pt] [--data SPEC] [--tol 1e-4]
    protofl-export quantize features.onnx --out int8.onnx [--mode dynamic|static] [--data SPEC]
    protofl-export bench [--from ARTIFACT | --arch cnn] [--profile rpi4 | --threads 2] [--batch 1,64]

`--from` reads a run's deployable artifacts (protofl/artifacts.py: simulate --out DIR, start's and join's
STATE_DIR/artifacts); `--device ID` picks a device of a run's folder. Without --from or --checkpoint the model
has seeded initial weights (--seed), to try the pipeline end to end.
Exit codes: 0 success, 1 verification failed (figures printed), 2 bad input (message says what to fix).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Any, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from protofl.errors import ConfigError, ProtoFLError
from protofl.requirements import explain_missing

app = typer.Typer(
    help="Export backbones to ONNX, verify, quantize and benchmark them.", no_args_is_help=True, add_completion=False
)
console = Console()
F = TypeVar("F", bound=Callable[..., Any])


def _friendly(fn: F) -> F:
    """Turn the package's own errors, and a missing torch or ONNX package, into one line on stderr and exit
    code 2 (no traceback)."""

    @wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            with explain_missing(f"protofl-export {fn.__name__}"):
                return fn(*args, **kwargs)
        except ProtoFLError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None

    return run  # type: ignore[return-value]


def _shape(text: str) -> tuple[int, int, int]:
    try:
        shape = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ConfigError(f"--in-shape must be c,h,w integers such as 1,28,28, got {text!r}") from None
    if len(shape) != 3:
        raise ConfigError(f"--in-shape must have three values c,h,w, got {text!r}")
    return shape


def _model(arch: str | None, checkpoint: Path | None, in_shape: str, classes: int, proto_dim: int, seed: int):
    from export.checkpoint import load_model

    return load_model(arch, checkpoint, in_shape=_shape(in_shape), num_classes=classes, proto_dim=proto_dim, seed=seed)


FROM = typer.Option(
    None,
    "--from",
    help="A run's deployable artifacts: a device's folder (RUN/devices/ID), a run's "
    "folder (its global state, or --device ID), or RUN/global.",
)
DEVICE = typer.Option(None, "--device", help="With --from RUN: which device's artifact.")


def _artifact(from_: Path | None, device: str | None, arch: str | None, checkpoint: Path | None):
    """The artifact --from names (export/artifact.py), or None without --from."""
    if from_ is None:
        if device is not None:
            raise ConfigError("--device picks a device of a run's artifacts: pass --from RUN as well")
        return None
    from export.artifact import load_artifact

    return load_artifact(from_, device=device, arch=arch, checkpoint=checkpoint)


def _recorded(meta: dict[str, str], arch: str | None, checkpoint: Path | None):
    """The artifact an ONNX file was exported --from (its metadata), where the user named no other model."""
    if arch or checkpoint or not meta.get("artifact"):
        return None
    rec = json.loads(meta["artifact"])
    if not Path(rec["from"]).exists():
        return None
    return _artifact(
        Path(rec["from"]),
        rec.get("device"),
        rec.get("arch"),
        Path(rec["checkpoint"]) if rec.get("checkpoint") else None,
    )


def _data(data: str | None, loaded: Any, meta: dict[str, str] | None = None) -> str:
    """--data, else the data the run recorded (artifact, or ONNX metadata), else Fashion-MNIST."""
    return data or (loaded.data if loaded is not None else None) or (meta or {}).get("data") or "fashion-mnist"


def _normalisation(checkpoint: Path | None, c: int, mean: str | None, std: str | None):
    """--mean/--std, else the checkpoint's record, else Fashion-MNIST's for 1-channel inputs, else 0/1."""
    from edge_agent.inference.onnx_runtime import parse_floats
    from export.checkpoint import load_checkpoint
    from protofl.data import FASHION_MNIST_MEAN, FASHION_MNIST_STD

    if mean or std:
        if not (mean and std):
            raise ConfigError("pass --mean and --std together")
        return parse_floats(mean), parse_floats(std)
    if checkpoint is not None:
        _, meta = load_checkpoint(checkpoint)
        if "norm_mean" in meta and "norm_std" in meta:
            return tuple(meta["norm_mean"]), tuple(meta["norm_std"])
    if c == 1:
        return FASHION_MNIST_MEAN, FASHION_MNIST_STD
    return (0.0,) * c, (1.0,) * c


@app.command()
@_friendly
def onnx(
    from_: Path | None = FROM,
    device: str | None = DEVICE,
    arch: str = typer.Option(None, help="Architecture (see `protofl-edge models`); optional with a checkpoint."),
    checkpoint: Path | None = typer.Option(None, help="ProtoNet checkpoint; none = seeded initial weights."),
    out: Path = typer.Option(..., "--out", help="Where to write the .onnx file."),
    opset: int | None = typer.Option(None, help="ONNX opset (default: the exporter's)."),
    what: str | None = typer.Option(
        None,
        help="features (x -> z), backbone (x -> h) or logits (x -> class scores); "
        "default: features; logits from a federation without prototypes "
        "(FedAvg's global model).",
    ),
    prototypes: Path | None = typer.Option(
        None,
        "--prototypes",
        help="With --from: where the prototype table goes (default: beside --out, NAME.prototypes.npz).",
    ),
    in_shape: str = typer.Option("1,28,28", help="Input shape c,h,w (without a checkpoint)."),
    classes: int = typer.Option(10, help="Number of classes (without a checkpoint)."),
    proto_dim: int = typer.Option(512, help="Prototype dimension m (without a checkpoint)."),
    seed: int = typer.Option(0, help="Seed of the initial weights (without a checkpoint)."),
    mean: str | None = typer.Option(None, help="Per-channel normalisation mean, e.g. 0.286 (recorded in metadata)."),
    std: str | None = typer.Option(None, help="Per-channel normalisation std, e.g. 0.353."),
    exporter: str = typer.Option("auto", help="auto (dynamo, TorchScript fallback), dynamo or torchscript."),
) -> None:
    """Export a model's features (or backbone, or classifier) to ONNX with a dynamic batch axis; from a run's
    artifact, with the prototype table that goes with it."""
    from edge_agent.inference.onnx_export import export_onnx

    loaded = _artifact(from_, device, arch, checkpoint)
    model = loaded.model if loaded is not None else _model(arch, checkpoint, in_shape, classes, proto_dim, seed)
    graph = what or (loaded.what if loaded is not None else "features")
    m, s = _normalisation(None if loaded is not None else checkpoint, model.in_shape[0], mean, std)
    if loaded is not None and not (mean or std) and loaded.norm is not None:
        m, s = loaded.norm
    elif loaded is not None and not (mean or std):
        typer.echo(
            f"note: the artifact records no input normalisation; using mean {m}, std {s} (--mean/--std to change)",
            err=True,
        )
    meta = _export_metadata(loaded, graph, out, prototypes)
    if from_ is not None:  # so that verify and quantize find what the graph came from by themselves
        meta["artifact"] = json.dumps(
            {
                "from": str(from_.resolve()),
                "device": device,
                "arch": arch,
                "checkpoint": str(checkpoint.resolve()) if checkpoint else None,
            }
        )
    info = export_onnx(model, out, what=graph, opset=opset, mean=m, std=s, exporter=exporter, metadata=meta)
    note = f" (dynamo failed: {info.fallback_reason})" if info.fallback_reason else ""
    typer.echo(
        f"wrote {info.path} ({info.path.stat().st_size / 1e6:.2f} MB): {model.arch} {info.what}, "
        f"input (batch,{','.join(map(str, model.in_shape))}) -> (batch,{info.out_dim}), opset {info.opset}, "
        f"{info.exporter} exporter{note}, {info.seconds:.1f} s"
    )
    if loaded is not None:
        typer.echo(f"from {loaded.note}")
        if "prototypes" in meta:
            typer.echo(
                f"wrote {info.path.parent / meta['prototypes']}: {len(loaded.prototypes.classes)} prototypes "
                f"({loaded.prototypes.values.shape[1]} values each, {loaded.prototypes.metric or 'l2'}, "
                f"{loaded.prototypes.source or 'given'}); protofl-edge predict --model {info.path} uses it"
            )


def _export_metadata(loaded: Any, what: str, out: Path, prototypes: Path | None) -> dict[str, str]:
    """What the ONNX file records of its artifact: class names, data spec, and the prototype table beside it
    (copied there; its name relative to the model, so the pair can be moved together)."""
    import shutil

    if loaded is None:
        return {}
    meta: dict[str, str] = {"source": loaded.note}
    if loaded.class_names:
        meta["class_names"] = json.dumps(loaded.class_names)
    if loaded.data:
        meta["data"] = loaded.data
    if getattr(loaded, "csv_scaling", None):
        meta["csv_scaling"] = json.dumps(loaded.csv_scaling)  # predict standardises new rows the same way
    if what == "features" and loaded.prototypes is not None:
        dest = prototypes or out.with_name(out.stem + ".prototypes.npz")
        dest.parent.mkdir(parents=True, exist_ok=True)
        src = loaded.prototypes_path
        assert src is not None
        if src.resolve() != dest.resolve():
            shutil.copyfile(src, dest)
        meta["prototypes"] = (
            str(dest.resolve().relative_to(out.resolve().parent))
            if dest.resolve().is_relative_to(out.resolve().parent)
            else str(dest.resolve())
        )
        meta["metric"] = loaded.prototypes.metric or "l2"
    elif what == "features":
        typer.echo("note: this artifact holds no prototype table; build one with protofl-edge predict --fit", err=True)
    return meta


@app.command()
@_friendly
def verify(
    model_path: Path = typer.Argument(..., metavar="MODEL.onnx", help="The exported model."),
    from_: Path | None = FROM,
    device: str | None = DEVICE,
    arch: str | None = typer.Option(None, help="Architecture to compare with (default: the file's metadata)."),
    checkpoint: Path | None = typer.Option(None, help="Checkpoint the export was made from."),
    data: str | None = typer.Option(
        None,
        help="Real inputs: a dataset spec (fashion-mnist, npz:PATH, idx:DIR, "
        "imagefolder:DIR, ...; default: the run's data, else fashion-mnist).",
    ),
    n: int = typer.Option(256, help="Number of test images compared."),
    tol: float = typer.Option(1e-4, help="Largest allowed absolute difference."),
    seed: int = typer.Option(0, help="Seed of the initial weights (without a checkpoint)."),
    classes: int | None = typer.Option(None, help="Number of classes (default: the file's metadata)."),
    proto_dim: int | None = typer.Option(None, help="Prototype dimension (default: the file's metadata)."),
) -> None:
    """ONNX checker + max abs difference vs PyTorch on real images; exit 1 above --tol."""
    from edge_agent.inference.onnx_runtime import parse_floats, read_metadata
    from export.verify import verify_onnx
    from protofl.data import load_images

    meta = read_metadata(model_path)
    loaded = _artifact(from_, device, arch, checkpoint) if from_ is not None else _recorded(meta, arch, checkpoint)
    model = (
        loaded.model
        if loaded is not None
        else _model(
            arch or meta.get("arch"),
            checkpoint,
            meta.get("in_shape", "1,28,28"),
            classes or int(meta.get("num_classes", 10)),
            proto_dim or int(meta.get("proto_dim", 512)),
            seed,
        )
    )
    x, _, _ = load_images(
        _data(data, loaded, meta),
        "test",
        n,
        in_shape=model.in_shape,
        mean=parse_floats(meta.get("norm_mean")),
        std=parse_floats(meta.get("norm_std")),
    )
    result = verify_onnx(model_path, model, x, tol)
    typer.echo(result.summary(), err=not result.ok)
    if not result.ok:
        raise typer.Exit(1)


def _named_classes(meta: dict[str, str]) -> list[str] | None:
    """The model's class names by class id (its metadata's), where they are more than the ids."""
    names = json.loads(meta["class_names"]) if meta.get("class_names") else None
    return [str(n) for n in names] if names and names != [str(i) for i in range(len(names))] else None


@app.command()
@_friendly
def quantize(
    model_path: Path = typer.Argument(..., metavar="MODEL.onnx", help="The fp32 model."),
    out: Path = typer.Option(..., "--out", help="Where to write the int8 model."),
    mode: str = typer.Option("dynamic", help="dynamic (weights only) or static (calibrated activations too)."),
    data: str | None = typer.Option(
        None,
        help="Calibration and accuracy data: a dataset spec (default: the run's "
        "data recorded in the model, else fashion-mnist; a device's model records the device's own data, so "
        "its accuracy is on that device's classes only). The accuracy is on its test split.",
    ),
    calib: int = typer.Option(512, help="Training images used for static calibration."),
    report: bool = typer.Option(
        True,
        "--report/--no-report",
        help="Measure the model's accuracy, fp32 vs int8, on --test-n test images of --data: by nearest "
        "prototype (class means of --train-n training images through each model), a logits graph by its argmax.",
    ),
    train_n: int = typer.Option(
        10000, help="Training images of --data whose class means (through each model) are the report's prototypes."
    ),
    test_n: int = typer.Option(10000, help="Test images of --data (its test split) the report classifies."),
    from_: Path | None = FROM,
    device: str | None = DEVICE,
    arch: str | None = typer.Option(None, help="With --checkpoint: also report the torch model's accuracy."),
    checkpoint: Path | None = typer.Option(None, help="Checkpoint the export was made from (for the torch column)."),
    threads: int | None = typer.Option(None, help="onnxruntime threads for the report."),
) -> None:
    """int8 quantisation with onnxruntime, and the accuracy it costs.

    The accuracy is the model's own, fp32 and int8, on --test-n test images of --data (default: the data its
    run recorded; for a device's model that is the device's own data, so its own classes only): by nearest
    prototype, the prototypes the class means of --train-n training images through each model (not the table
    shipped with the model), or for a logits graph (a global predictor) by its own argmax. The report's first
    line says which model, which data and how many of its classes."""
    from edge_agent.inference.onnx_runtime import parse_floats, read_metadata
    from export.quantize import compare_accuracy, quantize_model
    from protofl.data import load_images

    meta = read_metadata(model_path)
    loaded = _artifact(from_, device, arch, checkpoint)
    # where the data comes from, for the report's words: a device's recorded data holds its own classes only
    recorded = (loaded.data if loaded is not None else None) or meta.get("data")
    origin = "--data" if data else "the data its run recorded" if recorded else ""
    data = _data(data, loaded, meta)
    norm: dict[str, Any] = dict(mean=parse_floats(meta.get("norm_mean")), std=parse_floats(meta.get("norm_std")))
    if meta.get("in_shape"):
        norm["in_shape"] = _shape(meta["in_shape"])
    # class folders (a CSV's label names) labelled by the model's class names, as predict labels them
    norm["class_names"] = _named_classes(meta)
    calibration = None
    if mode == "static":
        calibration, _, _ = load_images(data, "train", calib, seed=1, **norm)
    path = quantize_model(model_path, out, mode, calibration)
    typer.echo(
        f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB, {mode} int8; fp32 was "
        f"{model_path.stat().st_size / 1e6:.2f} MB)"
    )
    _carry_prototypes(model_path, path, meta)
    if not report:
        return
    x_tr, y_tr, ds = load_images(data, "train", train_n, **norm)
    x_te, y_te, _ = load_images(data, "test", test_n, **norm)
    rep = compare_accuracy(
        model_path,
        path,
        mode,
        x_tr,
        y_tr,
        x_te,
        y_te,
        ds.num_classes,
        threads,
        what=meta.get("what", "features"),
        model=f"{model_path.name} ({meta['source']})" if meta.get("source") else model_path.name,
        data=data,
        data_origin=origin,
        model_classes=int(meta["num_classes"]) if meta.get("num_classes") else None,
    )
    typer.echo(rep.summary())
    if loaded is not None and meta.get("what", "features") == "features":
        import numpy as np

        from edge_agent.inference.extractor import TorchExtractor
        from protofl.algorithms.prototypes import local_prototypes, nearest_prototype

        ext = TorchExtractor(loaded.model)
        protos, _ = local_prototypes(ext.embed(x_tr), y_tr, ds.num_classes)
        acc = float(np.mean(nearest_prototype(ext.embed(x_te), protos) == y_te))
        typer.echo(f"torch fp32 nearest-prototype accuracy on the same images: {100 * acc:.2f}%")
    elif arch or checkpoint:
        import numpy as np

        from edge_agent.inference.extractor import TorchExtractor
        from protofl.algorithms.prototypes import local_prototypes, nearest_prototype

        if meta.get("what") == "backbone":
            raise ConfigError("the torch column compares features models; export with --what features")
        model = _model(
            arch or meta.get("arch"),
            checkpoint,
            meta.get("in_shape", "1,28,28"),
            int(meta.get("num_classes", 10)),
            int(meta.get("proto_dim", 512)),
            0,
        )
        ext = TorchExtractor(model)
        protos, _ = local_prototypes(ext.embed(x_tr), y_tr, ds.num_classes)
        acc = float(np.mean(nearest_prototype(ext.embed(x_te), protos) == y_te))
        typer.echo(f"torch fp32 nearest-prototype accuracy on the same images: {100 * acc:.2f}%")


def _carry_prototypes(src: Path, dst: Path, meta: dict[str, str]) -> None:
    """The prototype table an fp32 model names goes with its int8 version (the same name, relative to it)."""
    import shutil

    name = meta.get("prototypes")
    if not name or Path(name).is_absolute():
        return
    here, there = src.parent / name, dst.parent / name
    if here.is_file() and here.resolve() != there.resolve():
        there.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(here, there)
        typer.echo(f"copied its prototype table to {there}")


def _profile_threads(name: str) -> int:
    """`threads` of a device profile (NAME, FILE, or DEVICE+LINK), for `bench --profile`."""
    from protofl.profiles import parse_pair

    device, _ = parse_pair(name)
    if device is None:
        raise ConfigError(
            f"profile '{name}' names no device (a link profile has no CPU); pass a device profile "
            "such as rpi4, or --threads N"
        )
    if device.threads is None:
        raise ConfigError(
            f"device profile '{device.name}' sets no `threads`; add `threads = N` (its CPU cores) to "
            "its file, or pass --threads N"
        )
    return device.threads


@app.command()
@_friendly
def bench(
    from_: Path | None = FROM,
    device: str | None = DEVICE,
    arch: str | None = typer.Option(None, help="Architecture (or take it from --checkpoint)."),
    checkpoint: Path | None = typer.Option(None, help="Checkpoint; none = seeded initial weights."),
    model_path: Path | None = typer.Option(None, "--model", help="fp32 ONNX to time (default: export now)."),
    int8: Path | None = typer.Option(None, "--int8", help="int8 ONNX to time (default: quantize now)."),
    int8_mode: str = typer.Option("static", help="How to quantize when --int8 is not given: static or dynamic."),
    batch: str = typer.Option("1,64", help="Batch sizes, comma-separated."),
    threads: int | None = typer.Option(None, help="Intra-op threads for torch and onnxruntime (default 1)."),
    profile: str | None = typer.Option(None, help="Take --threads from a device profile's `threads` (NAME or FILE)."),
    iters: int = typer.Option(20, help="Timed runs per measurement (the median is reported)."),
    data: str | None = typer.Option(
        None,
        help="Input images (and static calibration): a dataset spec (default: the run's data, else fashion-mnist).",
    ),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the rows as JSON."),
) -> None:
    """Latency and throughput: torch vs onnxruntime fp32 vs int8."""
    from edge_agent.inference.onnx_export import export_onnx
    from export.bench import bench_model, speedups
    from export.quantize import quantize_model
    from protofl.data import load_images

    batches = tuple(int(b) for b in batch.split(","))
    n_threads = threads if threads is not None else (_profile_threads(profile) if profile else 1)
    loaded = _artifact(from_, device, arch, checkpoint)
    model = loaded.model if loaded is not None else _model(arch, checkpoint, "1,28,28", 10, 512, 0)
    what = loaded.what if loaded is not None else "features"
    m, s = _normalisation(None if loaded is not None else checkpoint, model.in_shape[0], None, None)
    if loaded is not None and loaded.norm is not None:
        m, s = loaded.norm
    data = _data(data, loaded)
    x, _, _ = load_images(data, "test", max(max(batches), 256), in_shape=model.in_shape, mean=m, std=s)
    with tempfile.TemporaryDirectory(prefix="protofl-bench-") as tmp:
        fp32 = model_path or export_onnx(model, Path(tmp) / "fp32.onnx", what=what, mean=m, std=s).path
        if int8 is None:
            calib = (
                load_images(data, "train", 512, in_shape=model.in_shape, mean=m, std=s, seed=1)[0]
                if int8_mode == "static"
                else None
            )
            int8 = quantize_model(fp32, Path(tmp) / "int8.onnx", int8_mode, calib)
        rows = bench_model(model, {"onnx-fp32": fp32, "onnx-int8": int8}, x, batches, n_threads, iters, what=what)
    gains = speedups(rows)
    where = f" (profile {profile})" if profile and threads is None else ""
    t = Table(title=f"{model.arch} {what}, {n_threads} thread(s){where}, median of {iters}")
    for col in ("backend", "batch", "latency ms", "images/s", "speed-up vs torch"):
        t.add_column(col, justify="left" if col == "backend" else "right")
    for r in rows:
        gain = gains.get((r.backend, r.batch))
        t.add_row(
            r.backend,
            str(r.batch),
            f"{r.latency_ms:.3f}",
            f"{r.throughput:,.0f}",
            "1.00x" if r.backend == "torch" else f"{gain:.2f}x",
        )
    console.print(t)
    if json_out is not None:
        json_out.write_text(json.dumps([r.as_dict() for r in rows], indent=2))


@app.command()
def version() -> None:
    """Print the exporter version."""
    from protofl import __version__

    typer.echo(f"protofl-export {__version__}")


if __name__ == "__main__":
    app()
