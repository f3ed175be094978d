"""Prototype-space extraction behind one small interface: torch, or onnxruntime.

The agent asks an :class:`Extractor` for z (to compute public and local prototypes and its metrics; the
round's objective turns z into class probabilities, so one forward pass serves every prediction).
:class:`TorchExtractor` is the reference (``trainer.embed``). :class:`OnnxExtractor` runs the *features*
graph on onnxruntime; because the agent trains between extractions, the graph is re-exported on demand
whenever the weights changed, detected by a fingerprint of the weights (so a round exports once, however
many times it extracts).

With a frozen backbone only the backbone is exported, once, and the few small layers after it
(stem, adapter, projection) run in torch: no per-round export at all.
"""

from __future__ import annotations

import hashlib
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from torch import nn

from edge_agent.inference.onnx_export import ExportError, export_onnx
from edge_agent.inference.onnx_runtime import embed_onnx, session
from edge_agent.training import trainer
from edge_agent.training.models import ProtoNet, head_probabilities
from protofl.data.dataset import Images
from protofl.errors import ConfigError
from protofl.names import EXTRACTORS, check_extractor

if TYPE_CHECKING:  # onnxruntime is optional
    from onnxruntime import InferenceSession

__all__ = ["EXTRACTORS", "Extractor", "OnnxExtractor", "TorchExtractor", "make_extractor", "weight_fingerprint"]


class Extractor(Protocol):
    model: ProtoNet

    def embed(self, x: trainer.Inputs) -> np.ndarray:
        """z (n, m) float32 for images x (n, c, h, w): normalised float32, or uint8 `Images` normalised per batch."""
        ...

    def predict_proba(self, x: trainer.Inputs) -> np.ndarray:
        """(n, C) class probabilities: the head's softmax (models.head_probabilities)."""
        ...


def weight_fingerprint(module: nn.Module) -> str:
    """A digest of every parameter and buffer (names, shapes, dtypes, values).

    Hashing is cheaper than an export (about 30 ms for resnet18's 45 MB) and, unlike a counter of
    optimiser steps, also notices weights loaded from the network.
    """
    h = hashlib.blake2b(digest_size=16)
    for name, t in module.state_dict().items():
        arr = t.detach().cpu().contiguous().numpy()
        h.update(f"{name}:{arr.dtype}:{arr.shape};".encode())
        h.update(memoryview(arr).cast("B"))
    return h.hexdigest()


def _as_numpy(x: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.ascontiguousarray(x, dtype=np.float32)


def _as_tensor(x: np.ndarray | torch.Tensor, like: nn.Module) -> torch.Tensor:
    device = next(like.parameters()).device
    if isinstance(x, torch.Tensor):
        return x.to(device=device, dtype=torch.float32)
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(device)


class TorchExtractor:
    """The reference: the model itself, in eval mode."""

    def __init__(self, model: ProtoNet) -> None:
        self.model = model

    def embed(self, x: trainer.Inputs) -> np.ndarray:
        return trainer.embed(self.model, x if isinstance(x, Images) else _as_tensor(x, self.model))

    def predict_proba(self, x: trainer.Inputs) -> np.ndarray:
        return head_probabilities(self.model, self.embed(x))


class OnnxExtractor:
    """z from onnxruntime, re-exporting the model when (and only when) its weights changed.

    ``frozen_backbone=True``: export only the backbone (once per backbone fingerprint) and finish in
    torch. ``threads``: onnxruntime intra-op threads (None: its default). ``exporters``: tried in order
    (see :func:`edge_agent.inference.onnx_export.export_onnx`). The TorchScript exporter comes first here, unlike in
    ``protofl-export onnx``: this export happens every round on the device, and it takes 0.05-0.25 s
    where the dynamo exporter takes 1-6 s (measured on x86 for cnn, resnet8, mobilenetv2), for graphs
    that agree with torch to 1e-6 either way. Where it is unavailable (it is deprecated) dynamo is used.
    """

    def __init__(
        self,
        model: ProtoNet,
        *,
        frozen_backbone: bool = False,
        threads: int | None = None,
        exporters: tuple[str, ...] = ("torchscript", "dynamo"),
        batch_size: int = 512,
    ) -> None:
        try:
            import onnxruntime  # noqa: F401
        except ImportError:
            raise ConfigError(
                "extractor 'onnx' needs onnxruntime: pip install 'protofl-edge[onnx]', or use --extractor torch"
            ) from None
        self.model = model
        self.frozen_backbone = frozen_backbone
        self.threads = threads
        self.exporters = exporters
        self.batch_size = batch_size
        self.exports = 0  # how many times the graph was (re-)exported
        self.export_seconds = 0.0
        self._fingerprint: str | None = None
        self._session: InferenceSession | None = None

    def _current_session(self) -> InferenceSession:
        part = self.model.backbone if self.frozen_backbone else self.model
        fp = weight_fingerprint(part)
        if fp != self._fingerprint or self._session is None:
            start = time.perf_counter()
            with tempfile.TemporaryDirectory(prefix="protofl-onnx-") as tmp:
                path = Path(tmp) / "model.onnx"
                self._export(path)
                # The session is built from bytes, so no file outlives the export.
                self._session = session(path.read_bytes(), self.threads, spin=False)
            self._fingerprint = fp
            self.exports += 1
            self.export_seconds += time.perf_counter() - start
        return self._session

    def _export(self, path: Path) -> None:
        what = "backbone" if self.frozen_backbone else "features"
        errors = []
        for exporter in self.exporters:
            try:
                export_onnx(self.model, path, what=what, exporter=exporter)
                return
            except ExportError as exc:
                errors.append(str(exc))
        raise ExportError(
            f"could not export the {self.model.arch} {what} graph: {'; '.join(errors)}; use --extractor torch"
        )

    def embed(self, x: trainer.Inputs) -> np.ndarray:
        sess = self._current_session()
        if isinstance(x, Images):  # normalised a block at a time, never the whole set
            block = self.batch_size * 8
            parts = [embed_onnx(sess, x[i : i + block], self.batch_size) for i in range(0, len(x), block)]
            out = np.concatenate(parts) if parts else embed_onnx(sess, x[0:0], self.batch_size)
        else:
            out = embed_onnx(sess, _as_numpy(x), self.batch_size)
        if not self.frozen_backbone:
            return out
        self.model.eval()  # as trainer.embed: extraction happens in eval mode
        with torch.inference_mode():
            z = self.model.features_from_backbone(_as_tensor(out, self.model))
        return z.cpu().numpy().astype(np.float32, copy=False)

    def predict_proba(self, x: trainer.Inputs) -> np.ndarray:
        return head_probabilities(self.model, self.embed(x))


def make_extractor(
    kind: str, model: ProtoNet, *, frozen_backbone: bool = False, threads: int | None = None
) -> Extractor:
    """``kind``: one of ``protofl.names.EXTRACTORS`` (``--extractor``)."""
    if check_extractor(kind) == "onnx":
        return OnnxExtractor(model, frozen_backbone=frozen_backbone, threads=threads)
    return TorchExtractor(model)
