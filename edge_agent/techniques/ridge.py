"""The ridge predictor's device half: this device's ridge statistics of the shared backbone's features, once.

The server half (the layout, the sums, the closed-form solve) is protofl/algorithms/ridge.py. In the first round
this device trains, it embeds its training data with the federation's shared backbone (shipped with the public
set; without one, the seeded initial model every device builds alike) and uploads [triu(G), B] as the training
phase's parameter vector, always float32 (an upload budget never makes it leaner: lossy statistics would bend
the fit); in later rounds it uploads that vector empty. Whether it has sent them is its checkpointed state.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from edge_agent.techniques import DeviceContext, DeviceRule
from edge_agent.training import trainer
from edge_agent.training.backbone import backbone_model, renormalize
from protofl.algorithms.ridge import ridge_length, ridge_statistics
from protofl.sparse import SparseVector


class RidgeDevice(DeviceRule):
    name = "ridge"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.sent = False

    def vector(self, ctx: DeviceContext) -> np.ndarray | SparseVector | None:
        cfg = self.cfg
        n = ridge_length(cfg.proto_dim, cfg.num_classes)
        if self.sent:
            return SparseVector(n, np.zeros(0, np.int64), np.zeros(0, np.float32))
        model = backbone_model(cfg, ctx.backbone).to(ctx.device)
        own = ctx.data_norm
        to = ctx.backbone_norm if own is not None else None  # the backbone's inputs as it was trained on them
        feats = trainer.embed(model, ctx.x, transform=lambda xb: renormalize(xb, own or ((), ()), to))
        self.sent = True
        return ridge_statistics(feats, ctx.y, cfg.num_classes)

    def vector_dtype(self) -> str | None:
        return "f4"

    def state(self) -> dict[str, Any]:
        return {"sent": self.sent}

    def load_state(self, state: dict[str, Any]) -> None:
        self.sent = bool(state.get("sent", False))
