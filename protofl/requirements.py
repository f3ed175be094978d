"""What a command needs beyond the base install, and what to tell the user when it is missing.

``pip install protofl-edge`` installs the numpy-only server side; PyTorch is the ``device`` extra
(``pip install 'protofl-edge[device]'``), because a server box does not need its ~700 MB and a Jetson
needs NVIDIA's own torch wheel rather than PyPI's. Commands that train or run a model call
:func:`require_torch` first, so that a missing torch is one line saying what to install (exit 2 in the
CLIs), not a traceback.

Nothing here imports torch: it is only looked up (``importlib.util.find_spec``), which keeps this
package numpy only.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager

from protofl.errors import ConfigError

__all__ = ["ONNX_INSTALL_HINT", "TORCH_INSTALL_HINT", "explain_missing", "require_torch", "torch_available"]

TORCH_INSTALL_HINT = (
    "pip install 'protofl-edge[device]' (on a Jetson, install NVIDIA's torch wheel for its JetPack first)"
)
ONNX_INSTALL_HINT = "pip install 'protofl-edge[onnx]'"
_ONNX_MODULES = ("onnx", "onnxruntime", "onnxscript")


def _missing(what: str, module: str) -> ConfigError:
    if module == "torch":
        return ConfigError(f"{what} needs PyTorch, which is not installed: {TORCH_INSTALL_HINT}")
    return ConfigError(f"{what} needs {module}, which is not installed: {ONNX_INSTALL_HINT}")


def torch_available() -> bool:
    """Whether ``import torch`` can find a torch installation (without importing it)."""
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):  # a finder that refuses torch; a broken torch module entry
        return False


def require_torch(what: str) -> None:
    """Raise :class:`ConfigError` saying what to install unless PyTorch is installed.

    ``what`` names the command or feature, e.g. ``"protofl-server simulate"``; the message reads
    "protofl-server simulate needs PyTorch, which is not installed: pip install 'protofl-edge[device]' ...".
    """
    if not torch_available():
        raise _missing(what, "torch")


@contextmanager
def explain_missing(what: str) -> Iterator[None]:
    """Inside: an ImportError of torch or of the ONNX packages becomes a ConfigError saying what to install.

    Only a missing package (the ImportError names torch, onnx, onnxruntime or onnxscript itself); an
    installed package that fails to import keeps its own error and traceback.
    """
    try:
        yield
    except ImportError as exc:
        if exc.name == "torch" or exc.name in _ONNX_MODULES:
            raise _missing(what, exc.name) from None
        raise
