"""Which torch device a run uses: `--device cpu | cuda | auto`, resolved once, with a clear error."""

from __future__ import annotations

from protofl.errors import ConfigError

DEVICES = ("cpu", "cuda", "auto")


def resolve_device(name: str) -> str:
    """ "cpu" or "cuda" for a `--device` value; "auto" is "cuda" where torch sees a CUDA device, else "cpu".

    Raises ConfigError for an unknown name, or for "cuda" on a machine where torch sees no CUDA device."""
    import torch

    if name not in DEVICES:
        raise ConfigError(f"--device must be {', '.join(DEVICES[:-1])} or {DEVICES[-1]}, got '{name}'")
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "--device cuda: torch sees no CUDA device (no GPU, or a CPU-only torch build); "
            "use --device cpu, or --device auto to take a GPU only where there is one"
        )
    return name
