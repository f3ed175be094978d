"""Flattening model parameters into vectors in a fixed, declared order (the federated adapter and the whole model).

The server side is numpy only and never sees a module: it sees a vector of length d plus a *layout*
(qualified name and shape of every slice, in order) that is published in the federation's config. Both
sides must therefore agree on one order, which is defined here and nowhere else:

* the federated adapter theta_a = (A_f, H): ``adapter_modules`` lists the modules, and inside each
  module the parameters follow ``named_parameters()`` (registration order, stable across processes);
* the full model (FedAvg): ``state_dict()`` order, parameters and floating-point buffers.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

__all__ = [
    "adapter_layout",
    "adapter_modules",
    "adapter_vector",
    "count_parameters",
    "full_layout",
    "full_vector",
    "load_adapter_vector",
    "load_full_vector",
]

Layout = list[tuple[str, tuple[int, ...]]]


def adapter_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The federated adapter theta_a = (A_f, H), as (prefix, module) pairs in the declared order."""
    adapter, head = model.get_submodule("adapter"), model.get_submodule("head")
    return [("adapter", adapter), ("head", head)]


def _adapter_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [
        (f"{prefix}.{name}", p) for prefix, module in adapter_modules(model) for name, p in module.named_parameters()
    ]


def _full_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    # keep_vars=True returns the live Parameters/buffers, so loading can copy into them in place.
    # Only floating-point entries travel: BatchNorm's running_mean/running_var are part of the model's
    # behaviour in eval mode and FedAvg averages them (as the reference implementations do), but
    # num_batches_tracked is an integer step counter -- averaging it is meaningless, it only matters
    # when BatchNorm momentum is None (not used here), and each client may keep its own.
    return [(name, t) for name, t in model.state_dict(keep_vars=True).items() if t.is_floating_point()]


def _layout(tensors: list[tuple[str, torch.Tensor]]) -> Layout:
    return [(name, tuple(int(s) for s in t.shape)) for name, t in tensors]


def _to_vector(tensors: list[tuple[str, torch.Tensor]]) -> np.ndarray:
    if not tensors:
        return np.zeros(0, dtype=np.float32)
    with torch.no_grad():
        flat = torch.cat([t.detach().reshape(-1).to(device="cpu", dtype=torch.float32) for _, t in tensors])
    return flat.numpy().copy()  # cpu: moved above; copy: the caller owns the array, later training must not alias it


def _load_vector(tensors: list[tuple[str, torch.Tensor]], vec: np.ndarray, what: str) -> None:
    arr = np.asarray(vec)
    expected = sum(t.numel() for _, t in tensors)
    if arr.ndim != 1:
        raise ValueError(f"{what} vector must be 1-D, got shape {arr.shape}")
    if arr.shape[0] != expected:
        raise ValueError(f"{what} vector has the wrong length: expected {expected}, got {arr.shape[0]}")
    src = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))
    offset = 0
    with torch.no_grad():
        for _, t in tensors:
            n = t.numel()
            t.copy_(src[offset : offset + n].view(t.shape).to(dtype=t.dtype, device=t.device))
            offset += n


def adapter_layout(model: nn.Module) -> Layout:
    """[(qualified name, shape)] of theta_a in vector order, e.g. ("adapter.down.weight", (32, 512))."""
    return _layout(_adapter_tensors(model))


def adapter_vector(model: nn.Module) -> np.ndarray:
    """theta_a flattened to a float32 vector of length d (in :func:`adapter_layout` order)."""
    return _to_vector(_adapter_tensors(model))


def load_adapter_vector(model: nn.Module, vec: np.ndarray) -> None:
    """Write a length-d vector back into the adapter and head (in place; ValueError on a wrong length)."""
    _load_vector(_adapter_tensors(model), vec, "adapter")


def full_layout(model: nn.Module) -> Layout:
    """[(state_dict key, shape)] of every parameter and floating-point buffer, in state_dict order."""
    return _layout(_full_tensors(model))


def full_vector(model: nn.Module) -> np.ndarray:
    """The whole model (parameters + BatchNorm statistics) as a float32 vector, for FedAvg."""
    return _to_vector(_full_tensors(model))


def load_full_vector(model: nn.Module, vec: np.ndarray) -> None:
    """Inverse of :func:`full_vector` (in place; ValueError on a wrong length)."""
    _load_vector(_full_tensors(model), vec, "full model")


def count_parameters(module: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameter scalars (buffers excluded), optionally only those with requires_grad."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)
