"""The ridge predictor's device half: ridge statistics of the shared backbone's features, and the route's updates.

The server half (the layout, the sums, the closed-form solve, the route's mean) is protofl/algorithms/ridge.py.

Without the route (`ridge_topk = 0`, or a server that ships no backbone: its round messages carry no `model`), in the
first round this device trains it embeds its training data with the federation's shared backbone (shipped with the
public set; without one, the seeded initial model every device builds alike) and uploads [triu(G), B] as the training
phase's parameter vector, always float32 (an upload budget never makes it leaner: lossy statistics would bend the
fit); in later rounds it uploads that vector empty. Whether it has sent them is its checkpointed state.

With the route, this device holds the global model g (the shared backbone whose head is the ridge head), kept equal
to the server's bit for bit from each round message's `model` (g's new values where it changed, or all of g), and
its error-feedback residual e. In a statistics round (1, T + 1, ...) it sends the statistics of g's backbone; in
the others it fine-tunes a copy of g on its training data (cross-entropy, the config's optimiser and local epochs)
and sends top-K of (g_local - g + e), keeping the rest in e. g, its version and e are its checkpointed state. A device
that holds another version of g than the round message's sends an empty vector (the server then ships all of g).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from edge_agent.techniques import DeviceContext, DeviceRule, Objective
from edge_agent.training import params as model_params
from edge_agent.training import trainer
from edge_agent.training.backbone import backbone_model, renormalize
from edge_agent.training.models import ProtoNet
from protofl.algorithms.ridge import (
    EVERY,
    TOPK,
    head_slice,
    is_stats_round,
    ridge_length,
    ridge_statistics,
    route_k,
    route_on,
    select_topk,
)
from protofl.sparse import SparseVector
from protofl.wire import RoundStart


def _empty(n: int) -> SparseVector:
    return SparseVector(n, np.zeros(0, np.int64), np.zeros(0, np.float32))


class _Renormed:
    """A model whose inputs, normalised as this device's data is, are normalised as the backbone's were first:
    what the trainer's loop reads (`features`, `head`)."""

    def __init__(self, model: ProtoNet, own: tuple[Sequence[float], Sequence[float]], target: Any) -> None:
        self.inner, self.own, self.target = model, own, target
        self.head = model.head

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.features(renormalize(x, self.own, self.target))


class RidgeDevice(DeviceRule):
    name = "ridge"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.sent = False
        cfg = self.cfg
        self.topk = float(cfg.options.get("ridge_topk", TOPK))
        self.every = int(cfg.options.get("ridge_every", EVERY))
        self.route = route_on(cfg)
        # The route's state: g (float32), its version, the residual e, and this round's view of the server's g.
        self.g: np.ndarray | None = None
        self.version = 0
        self.residual: np.ndarray | None = None
        self.round = 0
        self.served = False  # this round's message carries g (the server runs the route)
        self.server_n = 0  # the length of the server's g
        self.behind = False  # we hold another version of g than this round's message

    # -- the round message -----------------------------------------------------------------------
    def on_round(self, ctx: DeviceContext, round_: int, msg: RoundStart) -> None:
        self.round = round_
        m = msg.model
        self.served = self.route and m is not None
        if m is None or not self.route:
            return
        n = m.update.n
        g, version = self.g, self.version
        if g is None and ctx.backbone is not None:
            g, version = np.array(ctx.backbone, np.float32, copy=True), 0
        if m.dense is not None:
            g, version = np.array(m.dense, np.float32, copy=True), m.version
        elif g is not None and g.shape[0] == n and version == m.version - 1:
            g = g.copy()
            g[m.update.indices] = m.update.values
            version = m.version
        if g is not None and g.shape[0] == n:
            head_slice(n, self.cfg.proto_dim, self.cfg.num_classes)  # (the layout has a head's room)
        self.g, self.version, self.server_n = g, version, n
        self.behind = g is None or g.shape[0] != n or version != m.version

    def global_model(self) -> np.ndarray | None:
        return self.g if self.route and self.g is not None and self.version > 0 else None

    # -- the upload -------------------------------------------------------------------------------
    def vector(self, ctx: DeviceContext) -> np.ndarray | SparseVector | None:
        cfg = self.cfg
        n = ridge_length(cfg.proto_dim, cfg.num_classes)
        if not self.served:
            if self.sent:
                return _empty(n)
            self.sent = True
            return self._statistics(ctx, ctx.backbone)
        stats = is_stats_round(self.round, self.every)
        if self.behind or self.g is None:
            return _empty(n if stats else self.server_n)
        if stats:
            self.sent = True
            return self._statistics(ctx, self.g)
        return self._update(ctx, self.g)

    def _statistics(self, ctx: DeviceContext, vector: np.ndarray | None) -> np.ndarray:
        cfg = self.cfg
        model = backbone_model(cfg, vector).to(ctx.device)
        own = ctx.data_norm
        to = ctx.backbone_norm if own is not None else None  # the backbone's inputs as it was trained on them
        feats = trainer.embed(model, ctx.x, transform=lambda xb: renormalize(xb, own or ((), ()), to))
        return ridge_statistics(feats, ctx.y, cfg.num_classes)

    def _update(self, ctx: DeviceContext, g: np.ndarray) -> SparseVector:
        """Fine-tune a copy of g on this device's data; top-K of (g_local - g + e), the rest kept in e."""
        cfg = self.cfg
        model = backbone_model(cfg, g).to(ctx.device)
        layout = model_params.full_layout(model)
        if [name for name, _ in layout[-2:]] != ["head.weight", "head.bias"]:
            raise ValueError(f"the global model's vector does not end with its head ({layout[-2:]})")
        own = ctx.data_norm
        to = ctx.backbone_norm if own is not None else None
        view = _Renormed(model, own or ((), ()), to)
        model.train()
        y = torch.as_tensor(np.asarray(ctx.y, np.int64), device=ctx.device)
        seed = zlib.crc32(f"ridge/{cfg.seed}/{self.round}".encode() + np.asarray(ctx.y, np.int64).tobytes())
        trainer.sgd_epochs(view, list(model.parameters()), ctx.x, y, cfg, Objective(), seed)  # type: ignore[arg-type]
        local = model_params.full_vector(model.cpu())
        e = self.residual if self.residual is not None and self.residual.shape == g.shape else np.zeros_like(g)
        delta = (local - g) + e
        sent = select_topk(delta, route_k(g.shape[0], self.topk))
        e = delta.astype(np.float32, copy=True)
        e[sent.indices] -= sent.values  # e <- delta - sent: 0 where sent
        self.residual = e
        return sent

    def vector_dtype(self) -> str | None:
        return "f4"

    def state(self) -> dict[str, Any]:
        return {"sent": self.sent, "g": self.g, "version": self.version, "residual": self.residual}

    def load_state(self, state: dict[str, Any]) -> None:
        self.sent = bool(state.get("sent", False))
        g, e = state.get("g"), state.get("residual")
        self.g = None if g is None else np.array(g, np.float32, copy=True)
        self.version = int(state.get("version", 0) or 0)
        self.residual = None if e is None else np.array(e, np.float32, copy=True)
