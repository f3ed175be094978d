"""`protofl-edge`: the device's command line.

This module imports no torch: ``join`` and ``models`` run on PyTorch (the ``device`` extra) and, where it
is missing, say what to install instead of failing with a traceback; ``predict`` needs only onnxruntime.
"""

from __future__ import annotations

from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.core import TyperCommand

from protofl.errors import ConfigError
from protofl.requirements import TORCH_INSTALL_HINT, require_torch, torch_available

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
) -> None:
    """List the architectures: the built-ins and the installed `protofl.models` ones, with their sizes.

    `--arch package.module:factory` is accepted too (see `edge_agent.models`)."""
    from edge_agent.models import MODEL_GROUP, available_architectures, build_model
    from edge_agent.params import adapter_vector, count_parameters

    try:
        shape = tuple(int(v) for v in in_shape.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3:
        raise typer.BadParameter(f"c,h,w: three integers such as 1,28,28, got {in_shape!r}", param_hint="--in-shape")
    t = Table(
        title=f"architectures for input {shape}, m={proto_dim}, C={classes}",
        caption=f"also: --arch package.module:factory, or install a package registering {MODEL_GROUP}",
    )
    for col in ("arch", "backbone params", "backbone d", "adapter d", "total params"):
        t.add_column(col, justify="right" if col != "arch" else "left")
    for arch in available_architectures():
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
    Console().print(t)


@app.command()
def version() -> None:
    """Print the agent and wire-protocol versions."""
    from protofl import WIRE_VERSION, __version__

    typer.echo(f"protofl-edge {__version__} (wire protocol v{WIRE_VERSION})")


from edge_agent.predict import predict_command  # noqa: E402 -- registered after the commands above

app.command("predict")(predict_command)


from edge_agent.join_cli import join_command  # noqa: E402 -- the device loop, in its own module

_torch_command("join")(join_command)


from edge_agent.service_cli import service_app  # noqa: E402 -- systemd units, no torch

app.add_typer(service_app, name="service")

from edge_agent.doctor import doctor_command  # noqa: E402 -- no torch unless torch is the check

app.command("doctor")(doctor_command)


if __name__ == "__main__":
    app()
