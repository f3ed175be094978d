"""`protofl-edge`: the device's command line."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="protofl-edge device agent: join a federation, inspect models.",
                  no_args_is_help=True, add_completion=False)


@app.command()
def models(
    in_shape: str = typer.Option("1,28,28", help="Input shape c,h,w."),
    classes: int = typer.Option(10, help="Number of classes."),
    proto_dim: int = typer.Option(512, help="Prototype dimension m."),
) -> None:
    """List the built-in architectures with their backbone and adapter sizes."""
    from edge_agent.models import available_architectures, build_model
    from edge_agent.params import adapter_vector, count_parameters

    shape = tuple(int(v) for v in in_shape.split(","))
    t = Table(title=f"architectures for input {shape}, m={proto_dim}, C={classes}")
    for col in ("arch", "backbone params", "adapter d", "total params"):
        t.add_column(col, justify="right" if col != "arch" else "left")
    for arch in available_architectures():
        m = build_model(arch, shape, classes, proto_dim, seed=0)
        t.add_row(arch, f"{count_parameters(m.backbone):,}", f"{adapter_vector(m).shape[0]:,}",
                  f"{count_parameters(m):,}")
    Console().print(t)


@app.command()
def version() -> None:
    """Print the agent and wire-protocol versions."""
    from protofl import WIRE_VERSION, __version__

    typer.echo(f"protofl-edge {__version__} (wire protocol v{WIRE_VERSION})")


from edge_agent.predict import predict_command  # noqa: E402 -- registered after the commands above

app.command("predict")(predict_command)


from edge_agent.join_cli import join_command  # noqa: E402 -- the device loop, in its own module

app.command("join")(join_command)


if __name__ == "__main__":
    app()
