"""ProtoNet checkpoints: a plain dict of tensors and primitives, loaded with ``weights_only=True``.

Two files a federation leaves are read as well, neither of them pickled: a device's deployable model
(``devices/<id>/model.npz``, protofl/artifacts.py) and a device's resume checkpoint (``join --state-dir``:
``<fed>-<id>.ckpt``, protofl/checkpoint.py; its architecture is the federation's first unless --arch says).

A checkpoint is ``torch.save({"format": "protofl-checkpoint", "version": 1, "arch": ..., "in_shape": [...],
"num_classes": ..., "proto_dim": ..., "adapter_rank": ..., "projection": ..., "state_dict": {...}})``.
``torch.load(weights_only=True)`` only rebuilds tensors and primitive containers, so loading a file from
someone else never runs their code (a pickled ``nn.Module`` would). A bare ``state_dict`` is accepted
too; the model description then comes from the caller (the CLI options).
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edge_agent.training.models import ProtoNet, build_model
from protofl.artifacts import read_model
from protofl.checkpoint import MAGIC as CHECKPOINT_MAGIC
from protofl.checkpoint import CheckpointError, read_checkpoint
from protofl.errors import ConfigError, DataError

__all__ = ["CHECKPOINT_FORMAT", "ModelSpec", "load_checkpoint", "load_model", "save_checkpoint"]

CHECKPOINT_FORMAT = "protofl-checkpoint"


@dataclass(frozen=True)
class ModelSpec:
    """Everything :func:`build_model` needs besides the seed."""

    arch: str
    in_shape: tuple[int, int, int] = (1, 28, 28)
    num_classes: int = 10
    proto_dim: int = 512
    adapter_rank: int = 32
    projection: bool = False

    @classmethod
    def of(cls, model: ProtoNet) -> ModelSpec:
        return cls(
            model.arch,
            model.in_shape,
            model.num_classes,
            model.proto_dim,
            model.adapter.rank,
            model.projection is not None,
        )

    def build(self, seed: int | None = 0) -> ProtoNet:
        return build_model(
            self.arch,
            self.in_shape,
            self.num_classes,
            self.proto_dim,
            self.adapter_rank,
            projection=self.projection,
            seed=seed,
        )


def save_checkpoint(
    model: ProtoNet,
    path: str | os.PathLike[str],
    *,
    mean: tuple[float, ...] | None = None,
    std: tuple[float, ...] | None = None,
) -> Path:
    """Write ``model``'s weights and description to ``path`` (see the module docstring).

    ``mean``/``std``: the input normalisation the model was trained with, recorded so that an export
    can carry it into the ONNX metadata.
    """
    spec = ModelSpec.of(model)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    obj: dict[str, Any] = {
        "format": CHECKPOINT_FORMAT,
        "version": 1,
        "arch": spec.arch,
        "in_shape": list(spec.in_shape),
        "num_classes": spec.num_classes,
        "proto_dim": spec.proto_dim,
        "adapter_rank": spec.adapter_rank,
        "projection": spec.projection,
        "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
    }
    if mean is not None and std is not None:
        obj["norm_mean"], obj["norm_std"] = [float(v) for v in mean], [float(v) for v in std]
    torch.save(obj, p)
    return p


def _tensors(arrays: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}


def _federation_file(p: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """(state_dict, description) of a device's model.npz or resume checkpoint; None for any other file."""
    with p.open("rb") as fh:
        head = fh.read(len(CHECKPOINT_MAGIC))
    if head == CHECKPOINT_MAGIC:  # a device's resume checkpoint: msgpack, never torch.load
        try:
            state = read_checkpoint(p)
        except CheckpointError as exc:
            raise ConfigError(str(exc)) from None
        if not isinstance(state, dict) or "model" not in state or "cfg" not in state:
            raise ConfigError(
                f"{p} is a protofl checkpoint but not a device's (no model); export a device's "
                "artifacts instead: --from STATE_DIR/artifacts"
            )
        cfg = state["cfg"]
        meta = {
            "arch": cfg["archs"][0],
            "in_shape": cfg["in_shape"],
            "num_classes": cfg["num_classes"],
            "proto_dim": cfg["proto_dim"],
            "adapter_rank": cfg["adapter_rank"],
            "projection": any(k.startswith("projection.") for k in state["model"]),
            "arch_guessed": True,
        }
        return _tensors(state["model"]), meta
    if p.suffix == ".npz":
        try:
            arrays, spec = read_model(p)
        except DataError as exc:
            raise ConfigError(str(exc)) from None
        return _tensors(arrays), {k: v for k, v in spec.items() if k not in ("format", "version")}
    return None


def load_checkpoint(path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state_dict, description) from a checkpoint; the description is {} for a bare state_dict."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(
            f"checkpoint {p} does not exist; pass the path of a file written by save_checkpoint "
            "or torch.save(model.state_dict()), a device's artifacts/devices/<id>/model.npz, or "
            "leave --checkpoint out for seeded initial weights"
        )
    found = _federation_file(p)
    if found is not None:
        return found
    try:
        obj = torch.load(p, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as exc:
        # weights_only refuses anything but tensors and primitive containers: say why, not a traceback.
        raise ConfigError(
            f"checkpoint {p} cannot be loaded safely (weights_only=True): "
            f"{str(exc).splitlines()[0]}. Save plain state_dicts, never whole modules"
        ) from None
    if not isinstance(obj, dict):
        raise ConfigError(f"checkpoint {p}: expected a dict, got {type(obj).__name__}")
    if obj.get("format") == CHECKPOINT_FORMAT:
        state = obj.get("state_dict")
        meta = {k: v for k, v in obj.items() if k not in ("state_dict", "format", "version")}
    else:
        state, meta = obj, {}
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"checkpoint {p}: the state_dict must map parameter names to tensors")
    return state, meta


def load_model(
    arch: str | None,
    checkpoint: str | os.PathLike[str] | None,
    *,
    in_shape: tuple[int, int, int] = (1, 28, 28),
    num_classes: int = 10,
    proto_dim: int = 512,
    adapter_rank: int = 32,
    projection: bool = False,
    seed: int = 0,
) -> ProtoNet:
    """The model to export or compare against: the checkpoint's weights, else seeded initial weights.

    With a checkpoint, its recorded description wins over the keyword defaults; an explicit ``arch``
    that contradicts it is an error (exporting a resnet8 checkpoint "as cnn" is never what was meant).
    """
    if checkpoint is None:
        if not arch:
            raise ConfigError("no --arch and no --checkpoint: say which architecture to build")
        return ModelSpec(arch, in_shape, num_classes, proto_dim, adapter_rank, projection).build(seed)
    state, meta = load_checkpoint(checkpoint)
    if arch and meta.pop("arch_guessed", False):
        meta["arch"] = arch  # a resume checkpoint records the federation's archs, not which one this device ran
    if arch and meta.get("arch") and meta["arch"] != arch:
        raise ConfigError(
            f"checkpoint {checkpoint} holds a '{meta['arch']}' model but --arch is '{arch}'; "
            f"drop --arch or pass --arch {meta['arch']}"
        )
    name = arch or meta.get("arch")
    if not name:
        raise ConfigError(
            f"checkpoint {checkpoint} is a bare state_dict: pass --arch (and --in-shape, "
            "--classes, --proto-dim if not the defaults)"
        )
    spec = ModelSpec(
        str(name),
        tuple(int(v) for v in meta.get("in_shape", in_shape)),  # type: ignore[arg-type]
        int(meta.get("num_classes", num_classes)),
        int(meta.get("proto_dim", proto_dim)),
        int(meta.get("adapter_rank", adapter_rank)),
        bool(meta.get("projection", projection)),
    )
    model = spec.build(seed)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ConfigError(
            f"checkpoint {checkpoint} does not fit a {spec.arch} model with in_shape "
            f"{spec.in_shape}, {spec.num_classes} classes, proto_dim {spec.proto_dim}: "
            f"{' '.join(str(exc).split())[:400]} ... check --arch/--in-shape/--classes/--proto-dim"
        ) from None
    return model.eval()
