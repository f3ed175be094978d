"""``backbone = "frozen"``: compute backbone features once, train only what follows on the cache.

RefProtoFL's cost section has the backbone frozen (docs/algorithms.md). A frozen backbone's output
h = B(x) for the device's own data never changes, so the agent computes it once -- on onnxruntime when
available (the backbone exported once), else torch -- keeps it, and each round trains stem + adapter
(+ projection) + head on h. That removes the backbone's forward *and* backward pass from every
training step, which is most of the on-device compute.

The cache is keyed by a fingerprint of the backbone's weights: should they change (a FedAvg round
loading a full parameter vector, a new config building a new model), h is recomputed, never reused
stale.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from edge_agent.inference.extractor import weight_fingerprint
from edge_agent.inference.onnx_export import export_onnx
from edge_agent.inference.onnx_runtime import embed_onnx, session
from edge_agent.training import trainer
from edge_agent.training.models import ProtoNet
from protofl.config import FederationConfig
from protofl.errors import ConfigError

if TYPE_CHECKING:
    from edge_agent.techniques import Objective

__all__ = ["BACKENDS", "FrozenBackbone", "compute_backbone_features", "train_on_cached_features"]

BACKENDS = ("auto", "onnx", "torch")


def _onnx_available() -> bool:
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


# no_grad, not inference_mode: the cache is later sliced into autograd graphs, which inference tensors refuse.
@torch.no_grad()
def _torch_backbone(model: ProtoNet, x: trainer.Inputs, batch_size: int, device: torch.device) -> torch.Tensor:
    was = model.backbone.training
    model.backbone.eval()  # frozen means BatchNorm running statistics, as in train_local
    try:
        return torch.cat(
            [
                model.backbone_features(trainer.rows(x, slice(i, i + batch_size), device))
                for i in range(0, len(x), batch_size)
            ]
        )
    finally:
        model.backbone.train(was)


def compute_backbone_features(
    model: ProtoNet, x: trainer.Inputs, backend: str = "auto", batch_size: int = 512, threads: int | None = None
) -> tuple[torch.Tensor, str]:
    """(h, backend used) for every row of ``x``; h is float32 on x's device, (n, backbone_dim)."""
    if backend not in BACKENDS:
        raise ConfigError(f"frozen backbone backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    use_onnx = backend == "onnx" or (backend == "auto" and _onnx_available())
    if backend == "onnx" and not _onnx_available():
        raise ConfigError("frozen backbone on onnxruntime needs onnx and onnxruntime: pip install 'protofl-edge[onnx]'")
    device = x.device if isinstance(x, torch.Tensor) else next(model.parameters()).device
    if len(x) == 0:
        return torch.zeros(0, model.backbone_dim, device=device), "torch"
    if not use_onnx:
        return _torch_backbone(model, x, batch_size, device), "torch"
    with tempfile.TemporaryDirectory(prefix="protofl-backbone-") as tmp:
        path = Path(tmp) / "backbone.onnx"
        export_onnx(model, path, what="backbone")
        sess = session(path.read_bytes(), threads, spin=False)
    if isinstance(x, torch.Tensor):
        h = embed_onnx(sess, x.detach().cpu().numpy(), batch_size)
    else:  # a block of rows at a time: uint8 images are never normalised all at once
        block = batch_size * 8
        h = np.concatenate(
            [embed_onnx(sess, np.asarray(x[i : i + block]), batch_size) for i in range(0, len(x), block)]
        )
    return torch.from_numpy(h).to(device), "onnx"


class FrozenBackbone:
    """The agent's cache of h for its local data, recomputed only if the backbone's weights change."""

    def __init__(self, backend: str = "auto", threads: int | None = None) -> None:
        self.backend = backend
        self.threads = threads
        self.h: torch.Tensor | None = None
        self.used = ""  # backend that computed the current cache
        self.seconds = 0.0  # time to compute it (a one-off cost per device)
        self._key: tuple[str, tuple[int, ...]] | None = None

    def features(self, model: ProtoNet, x: trainer.Inputs) -> torch.Tensor:
        key = (weight_fingerprint(model.backbone), tuple(x.shape))
        if self.h is None or key != self._key:
            start = time.perf_counter()
            self.h, self.used = compute_backbone_features(model, x, self.backend, threads=self.threads)
            self.seconds = time.perf_counter() - start
            self._key = key
        return self.h


class _CachedView:
    """Looks like a ProtoNet to ``trainer.sgd_epochs``, but ``features`` starts from cached h.

    Reusing the trainer's loss (not a copy of it) keeps frozen and trainable training on exactly the
    same objective for every technique.
    """

    def __init__(self, model: ProtoNet) -> None:
        self.features = model.features_from_backbone
        self.head = model.head


def train_on_cached_features(
    model: ProtoNet,
    h: torch.Tensor,
    y: torch.Tensor,
    cfg: FederationConfig,
    objective: Objective,
    seed: int,
    momentum: trainer.Momentum | None = None,
) -> trainer.TrainStats:
    """``trainer.train_local`` for a frozen backbone, on cached h: same epochs, batch order, optimiser.

    Only stem, adapter, projection and head are optimised; the backbone's parameters get
    ``requires_grad=False`` and are never touched (its BatchNorm stays in eval mode).
    """
    if len(h) != len(y):
        raise ValueError(f"cached features: {len(h)} rows of h for {len(y)} labels; recompute the cache")
    for p in model.backbone.parameters():
        p.requires_grad_(False)
    fixed_head = objective.fixed_head
    named = [
        (name, p)
        for name, p in model.named_parameters()
        if not name.startswith("backbone.") and not (fixed_head and name.startswith("head."))
    ]
    params = [p for _, p in named]
    for p in model.head.parameters():
        p.requires_grad_(not fixed_head)
    for p in params:
        p.requires_grad_(True)
    model.train()
    model.backbone.eval()
    return trainer.sgd_epochs(
        _CachedView(model),  # type: ignore[arg-type]
        params,
        h,
        y,
        cfg,
        objective,
        seed,
        momentum=momentum,
        names=[name for name, _ in named],
    )
