"""`protofl-export`: ONNX export of backbones for inference-time prototype extraction."""

from __future__ import annotations

import typer

app = typer.Typer(help="Export backbones to ONNX, verify, quantize and benchmark them.",
                  no_args_is_help=True, add_completion=False)


@app.command()
def version() -> None:
    """Print the exporter version."""
    from protofl import __version__

    typer.echo(f"protofl-export {__version__}")


if __name__ == "__main__":
    app()
