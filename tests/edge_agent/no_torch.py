"""Run `protofl-edge` with torch made unimportable (issue 57's lite device): any `import torch` (or of a package that
imports it) fails as it does where torch is not installed. `python tests/edge_agent/no_torch.py join ...`."""

from __future__ import annotations

import importlib.abc
import sys

BLOCKED = ("torch", "torchvision", "onnxscript")


class _NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named '{name}' (blocked: a lite device has no torch)", name=name)
        return None


def main() -> None:
    sys.meta_path.insert(0, _NoTorch())
    for name in list(sys.modules):
        if name.split(".")[0] in BLOCKED:
            del sys.modules[name]
    from edge_agent.cli import app

    sys.argv[0] = "protofl-edge"
    app()


if __name__ == "__main__":
    main()
