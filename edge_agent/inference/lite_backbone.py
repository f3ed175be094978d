"""The shared backbone on a lite device: its ONNX graph in onnxruntime, weights fed from the flat parameter vector.

The server ships the backbone as it always has (`PublicSet.backbone`: the whole parameter vector of the federation's
first architecture, as edge_agent/training/params.py flattens it) and, beside it, the graph of its forward pass x -> h
without weights (`PublicSet.graph`), whose weights are graph inputs named as `PublicSet.layout` names the vector's
slices (protofl/lite.py). So the weights are never frozen into the graph: `load(vector)` replaces them all at once
(views into the vector, no copy), and a backbone that changes during a run (a sparse update applied to the vector)
is one `load` away. The graph is made by `export_backbone_graph` (torch, on the server's side: the child process of
`protofl-server start` that trains the backbone, edge_agent/training/backbone.py).

onnxruntime and numpy only: no torch import here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from protofl.errors import ConfigError

__all__ = ["LiteBackbone", "renormalize_np"]

# Rows a forward pass at a time: the activations of a batch are what the session's memory grows by (the cnn at
# 1x28x28: ~0.4 MB a row; 256 rows held ~100 MB more at the peak than 32: bench/results/LITE.md).
EMBED_BATCH = 32


class LiteBackbone:
    """`embed(x)`: the backbone's features of normalised float32 images, with the weights last `load`ed."""

    def __init__(self, graph: bytes, layout: Sequence[tuple[str, tuple[int, ...]]], threads: int | None = None) -> None:
        try:
            import onnxruntime as ort
        except ImportError:
            raise ConfigError(
                "a lite device needs onnxruntime: pip install 'protofl-edge[lite]' (or onnxruntime)"
            ) from None
        so = ort.SessionOptions()
        if threads is not None:
            so.intra_op_num_threads = max(1, threads)
            so.inter_op_num_threads = 1
        try:
            self.session = ort.InferenceSession(graph, so, providers=["CPUExecutionProvider"])
        except Exception as exc:  # noqa: BLE001 -- onnxruntime raises its own exception types
            raise ConfigError(
                f"the server's backbone graph does not load in onnxruntime {ort.__version__}: {exc}"
            ) from None
        self.layout = [(str(n), tuple(int(d) for d in sh)) for n, sh in layout]
        self.size = sum(math.prod(sh) for _, sh in self.layout)
        inputs = [i.name for i in self.session.get_inputs()]
        self.input = inputs[0]
        known = {n for n, _ in self.layout}
        missing = [n for n in inputs[1:] if n not in known]
        if missing:
            raise ConfigError(f"the backbone graph takes weights the layout does not name: {missing[:3]}")
        self.weight_names = inputs[1:]
        self.weights: dict[str, np.ndarray] = {}

    def load(self, vector: np.ndarray) -> None:
        """Use `vector` (the backbone's whole parameter vector, float32) as the graph's weights."""
        v = np.ascontiguousarray(vector, np.float32)
        if v.shape != (self.size,):
            raise ConfigError(f"backbone vector of {v.size} values; the graph's layout has {self.size}")
        used, off = set(self.weight_names), 0
        weights = {}
        for name, shape in self.layout:
            n = math.prod(shape)
            if name in used:
                weights[name] = v[off : off + n].reshape(shape)
            off += n
        self.weights = weights

    def embed(self, x: np.ndarray, batch_size: int = EMBED_BATCH) -> np.ndarray:
        """Features (n, d) of the rows of `x` (normalised float32, or anything whose slices are: `Images`)."""
        if not self.weights and self.weight_names:
            raise ConfigError("the backbone has no weights yet: load its vector first")
        n = len(x)
        out: np.ndarray | None = None
        for i in range(0, n, batch_size):
            xb = np.ascontiguousarray(x[i : i + batch_size], np.float32)
            h = self.session.run(None, {self.input: xb, **self.weights})[0]
            if out is None:
                out = np.empty((n, *h.shape[1:]), np.float32)
            out[i : i + len(h)] = h
        return np.zeros((0, 0), np.float32) if out is None else out


def renormalize_np(
    x: np.ndarray, frm: tuple[Sequence[float], Sequence[float]], to: tuple[Sequence[float], Sequence[float]] | None
) -> np.ndarray:
    """edge_agent/training/backbone.renormalize in numpy: inputs normalised with `frm`, normalised with `to` instead
    (the backbone's); `to` None or the same: as they are."""
    same = to is not None and all(
        len(a) == len(b) and all(np.float32(u) == np.float32(v) for u, v in zip(a, b, strict=True))
        for a, b in zip(frm, to, strict=True)
    )
    if to is None or same:
        return x
    shape = (1, -1, 1, 1)
    m0, s0 = (np.asarray(v, np.float32).reshape(shape) for v in frm)
    m1, s1 = (np.asarray(v, np.float32).reshape(shape) for v in to)
    return (((x * s0 + m0) - m1) / s1).astype(np.float32, copy=False)
