"""`protofl-edge`: the device's command line.

This module imports no torch: ``join`` and ``models`` run on PyTorch (the ``device`` extra) and, where it
is missing, say what to install instead of failing with a traceback; ``predict`` needs only onnxruntime.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.core import TyperCommand

from protofl.errors import ConfigError
from protofl.requirements import TORCH_INSTALL_HINT, require_torch, torch_available

if TYPE_CHECKING:  # the footprint file's reader imports torch: only inside the command
    from edge_agent.ops.model_sizes import Footprint

app = typer.Typer(
    help="protofl-edge device agent: join a federation, inspect models.", no_args_is_help=True, add_completion=False
)


class TorchCommand(TyperCommand):
    """A command that runs on PyTorch: without it, one line saying what to install and exit 2.

    Checked before the arguments are parsed, so that a missing torch is what the user hears first (not
    a missing option); ``--help`` still works and, where torch is missing, ends with the same hint.
    """

    # ctx: Any, not typer.Context. The base method declares click's Context, a base of typer.Context (and a
    # private name, typer._click.core.Context, in the typer releases that vendor click): declaring the
    # subclass would narrow the override's parameter.
    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if not set(args) & set(self.get_help_option_names(ctx)):
            try:
                require_torch(f"protofl-edge {self.name}")
            except ConfigError as exc:
                typer.echo(f"error: {exc}", err=True)
                raise typer.Exit(2) from None
        return super().parse_args(ctx, args)


def _torch_command(name: str) -> Any:
    """Register a TorchCommand; where torch is missing, its --help ends with what to install."""
    hint = f"PyTorch is not installed here; this command needs it: {TORCH_INSTALL_HINT}."
    return app.command(name, cls=TorchCommand, epilog=None if torch_available() else escape(hint))  # rich markup


@_torch_command("models")
def models(
    in_shape: str = typer.Option("1,28,28", help="Input shape c,h,w."),
    classes: int = typer.Option(10, help="Number of classes."),
    proto_dim: int = typer.Option(512, help="Prototype dimension m."),
    presets: str = typer.Option(
        "fedavg,fedproto,protofl", help="Presets whose upload bytes and measured memory to show, comma-separated."
    ),
    profile: str | None = typer.Option(
        None, help="A device profile (rpi3, rpi4, ... or a TOML file): say which models fit its memory_mb."
    ),
    archs: str | None = typer.Option(None, help="Only these architectures, comma-separated (default: all)."),
) -> None:
    """List the architectures with their sizes, and per preset the bytes a round uploads and the measured peak
    memory of training each, so that you can pick a model that fits a device.

    Parameters and upload bytes are computed here (the device's own upload code and wire encoding); the peak
    resident memory of `join` is read from the footprint benchmark's measurements (bench/bench_footprint.py),
    taken at 1,28,28, 10 classes, m=512 with one thread. `--arch package.module:factory` is accepted too (see
    `edge_agent.training.models`)."""
    from protofl.humanize import human_bytes
    from protofl.presets import preset_names
    from protofl.profiles import load_device

    try:
        shape = tuple(int(v) for v in in_shape.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3:
        raise typer.BadParameter(f"c,h,w: three integers such as 1,28,28, got {in_shape!r}", param_hint="--in-shape")
    chosen = [p.strip() for p in presets.split(",") if p.strip()]
    unknown = [p for p in chosen if p not in preset_names()]
    if unknown or not chosen:
        raise typer.BadParameter(
            f"unknown preset(s) {unknown or presets!r}; known: {', '.join(preset_names())}", param_hint="--presets"
        )
    try:
        device = load_device(profile) if profile else None
    except ConfigError as exc:
        raise typer.BadParameter(str(exc), param_hint="--profile") from None
    # torch from here on: the arguments were checked first
    from edge_agent.ops.model_sizes import MEASURED_SHAPE, load_footprint, round_bytes
    from edge_agent.training.models import MODEL_GROUP, available_architectures, build_model
    from edge_agent.training.params import adapter_vector, count_parameters

    footprint = load_footprint()
    measured = footprint is not None and (shape, classes, proto_dim) == MEASURED_SHAPE
    t = Table(
        title=f"architectures for input {shape}, m={proto_dim}, C={classes}",
        caption=f"also: --arch package.module:factory, or install a package registering {MODEL_GROUP}",
    )
    for col in ("arch", "backbone params", "backbone d", "adapter d", "total params"):
        t.add_column(col, justify="right" if col != "arch" else "left")
    per_preset = Table(
        title="per preset: bytes one device uploads a round (envelopes included), peak memory of `join` training it",
        caption=_models_caption(footprint, measured),
    )
    for col in ("arch", "preset", "upload / round", "round 1", "peak RSS (measured)"):
        per_preset.add_column(col, justify="left" if col in ("arch", "preset") else "right")
    if device is not None:
        per_preset.add_column(f"fits {device.name} ({device.memory_mb} MB)", justify="left")
    names = available_architectures() if archs is None else [a.strip() for a in archs.split(",") if a.strip()]
    for arch in names:
        try:
            m = build_model(arch, shape, classes, proto_dim, seed=0)
        except ConfigError as exc:  # an installed model that does not build here: say why, list the rest
            t.add_row(arch, f"[red]{escape(str(exc))}[/red]", "", "", "")
            continue
        t.add_row(
            arch,
            f"{count_parameters(m.backbone):,}",
            f"{m.backbone_dim:,}",
            f"{adapter_vector(m).shape[0]:,}",
            f"{count_parameters(m):,}",
        )
        for preset in chosen:
            up = round_bytes(arch, preset, shape, classes, proto_dim)
            peak = footprint.peak(arch, preset) if footprint is not None and measured else None
            row = [
                arch,
                preset,
                f"{up.later:,} B ({human_bytes(up.later)})",
                "" if up.first == up.later else f"{up.first:,} B ({human_bytes(up.first)})",
                "not measured" if peak is None else f"{peak:.0f} MB",
            ]
            if device is not None:
                row.append("?" if peak is None else ("yes" if peak <= device.memory_mb else "[red]no[/red]"))
            per_preset.add_row(*row)
    console = Console()
    console.print(t)
    console.print(per_preset)


def _models_caption(footprint: Footprint | None, measured: bool) -> str:
    if footprint is None:
        return "peak RSS: no footprint.json here (run python -m bench.bench_footprint --package-data ...)"
    where = f"measured {footprint.date} on {footprint.machine}, --threads {footprint.threads}: {footprint.command}"
    if not measured:
        return f"peak RSS was measured at 1,28,28, 10 classes, m=512 only ({where})"
    return f"round 1: where it differs (something travels once). Peak RSS {where}"


@app.command()
def profiles() -> None:
    """List the device and link profiles `join --profile` takes (NAME, or DEVICE+LINK), with what each says."""
    from protofl.profiles import DeviceProfile, known_profiles, load_profile, search_dirs

    devices = Table(title="device profiles (join --profile NAME)")
    links = Table(title="link profiles (join --profile DEVICE+LINK: adaptive uploads fitted to the link)")
    for col in ("name", "memory", "compute", "description", "file"):
        devices.add_column(col, justify="right" if col in ("memory", "compute") else "left")
    for col in ("name", "up", "down", "rtt", "description", "file"):
        links.add_column(col, justify="right" if col in ("up", "down", "rtt") else "left")
    for name, path in known_profiles().items():
        try:
            p = load_profile(str(path))
        except ConfigError as exc:
            devices.add_row(escape(name), "", "", f"[red]{escape(str(exc))}[/red]", escape(str(path)))
            continue
        if isinstance(p, DeviceProfile):
            devices.add_row(
                escape(name), f"{p.memory_mb} MB", f"{p.compute_factor:g}x", escape(p.description), escape(str(path))
            )
        else:
            links.add_row(
                escape(name),
                f"{p.uplink_kbps:g} kbit/s",
                f"{p.downlink_kbps:g} kbit/s",
                f"{p.rtt_ms:g} ms",
                escape(p.description),
                escape(str(path)),
            )
    console = Console()
    console.print(devices)
    console.print(links)
    where = ", ".join(str(d) for d in search_dirs())
    typer.echo(f"searched: {where} (add yours: a TOML file in a folder named by $PROTOFL_PROFILES, or --profile FILE)")


@app.command()
def version() -> None:
    """Print the agent and wire-protocol versions."""
    from protofl import WIRE_VERSION, __version__

    typer.echo(f"protofl-edge {__version__} (wire protocol v{WIRE_VERSION})")


from edge_agent.inference.predict import predict_command  # noqa: E402 -- registered after the commands above

app.command("predict")(predict_command)


from edge_agent.join_cli import join_command  # noqa: E402 -- the device loop, in its own module

# Not a TorchCommand: without torch, `join` runs a lite device (onnxruntime; edge_agent/ops/lite.py).
app.command("join")(join_command)


from edge_agent.service_cli import service_app  # noqa: E402 -- systemd units, no torch

app.add_typer(service_app, name="service")

from edge_agent.ops.doctor import doctor_command  # noqa: E402 -- no torch unless torch is the check

app.command("doctor")(doctor_command)


if __name__ == "__main__":
    app()
