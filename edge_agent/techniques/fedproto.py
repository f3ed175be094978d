"""FedProto's device half: per-class mean prototypes (with their counts) go up; the round's global
prototypes come down as alignment targets (cross-entropy + lambda * the alignment term), and the metrics
classify by the nearest of them (L2) beside the head.

The alignment term and the nearest-target classifier are shared by every mean-prototype technique
(public-set anchors and masked targets arrive as dense tables too). The server half is
protofl/algorithms/fedproto.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from edge_agent.techniques import (
    AlignmentTerm,
    Classifier,
    DeviceContext,
    DeviceRule,
    LossTerm,
    NearestTargetClassifier,
)
from protofl.algorithms.prototypes import local_prototypes


class FedProtoDevice(DeviceRule):
    name = "fedproto"

    def local_prototypes(self, z: np.ndarray, y: np.ndarray) -> tuple[dict[int, np.ndarray], dict[int, int] | None]:
        return local_prototypes(z, y, self.plan.num_classes)

    def classifier(self, ctx: DeviceContext, table: dict[int, np.ndarray], fresh: bool) -> Classifier | None:
        return NearestTargetClassifier(table) if table else None

    def loss_terms(self, ctx: DeviceContext, table: dict[int, np.ndarray], fresh: bool) -> Sequence[LossTerm]:
        if not table:
            return ()
        return (AlignmentTerm(table, self.plan.num_classes, self.plan.proto_dim, self.cfg.proto_lambda, ctx.device),)
