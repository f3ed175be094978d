"""FedPAGR's device half (paper 004, Alg. 1 on the client): unit prototypes, the consensus projection
g_k, the anchored head and the composite loss.

Each round the refined prototypes P (C x m, unit rows) arrive; the head's rows are set to P (bias 0) and
stay fixed while f_k and g_k train (`pagr_train_head` is the variant that trains it too) on

    CE(head(z_hat), y) + CE(z_hat . P^T / beta, y) + lambda_E * L_ent,      z_hat = z / ||z||,

with L_ent = -(1/|B|) sum_x (1/C) sum_c log softmax(z_hat . P^T / beta)_c, a uniformity pressure that
keeps the prototypes from collapsing onto one direction. The upload is eq. (2)'s unit class means. The
server half (consensus, refinement) is protofl/algorithms/fedpagr.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from edge_agent.techniques import DeviceContext, DeviceRule, Objective
from protofl.algorithms import unit
from protofl.errors import WireError


def entropy_regulariser(proto_logits: torch.Tensor) -> torch.Tensor:
    """L_ent = -(1/|B|) sum_x (1/C) sum_c log softmax(logits)_c."""
    return -F.log_softmax(proto_logits, dim=1).mean(dim=1).mean()


def fedpagr_loss(z: torch.Tensor, y: torch.Tensor, head: torch.nn.Module, prototypes: torch.Tensor,
                 beta: float, lambda_e: float) -> torch.Tensor:
    """CE(head(z_hat), y) + CE((z_hat . P^T) / beta, y) + lambda_E * L_ent, with z_hat = z/||z||."""
    z_hat = F.normalize(z, dim=1)
    proto_logits = z_hat @ prototypes.t() / beta
    return (
        F.cross_entropy(head(z_hat), y)
        + F.cross_entropy(proto_logits, y)
        + lambda_e * entropy_regulariser(proto_logits)
    )


class PagrObjective(Objective):
    """The composite loss against P; with the consensus projection, the metrics classify by cosine to P."""

    def __init__(self, P: torch.Tensor, beta: float, lambda_e: float, train_head: bool, cosine: bool) -> None:
        self.P, self.beta, self.lambda_e, self.cosine = P, beta, lambda_e, cosine
        self.fixed_head = not train_head
        self.metric = "cosine" if cosine else None

    def loss(self, z: torch.Tensor, y: torch.Tensor, head: torch.nn.Module) -> torch.Tensor:
        return fedpagr_loss(z, y, head, self.P, self.beta, self.lambda_e)

    def probabilities(self, model: Any, z: np.ndarray) -> np.ndarray:
        from edge_agent.extractor import class_probabilities

        return class_probabilities(model, z, self.P if self.cosine else None, self.beta)

    def nearest_correct(self, z: np.ndarray, y: np.ndarray, probs: np.ndarray) -> int | None:
        # softmax(cos(z, P) / beta) has the nearest prototype by cosine as its argmax.
        if not self.cosine:
            return None
        return int((probs.argmax(1) == y).sum()) if len(probs) else 0

    def table(self) -> dict[int, np.ndarray]:
        P = self.P.detach().cpu().numpy()
        return {c: P[c] for c in range(P.shape[0])}


class FedPagrDevice(DeviceRule):
    name = "fedpagr"

    def model_options(self) -> dict[str, Any]:
        return {"projection": bool(self.cfg.consensus)}

    def local_prototypes(self, z: np.ndarray, y: np.ndarray) -> tuple[dict[int, np.ndarray], dict[int, int] | None] | None:
        if self.plan.prototypes != "unit":
            return None
        return unit.client_prototypes(z, y, self.plan.num_classes), None

    def objective(self, ctx: DeviceContext, table: dict[int, np.ndarray], fresh: bool) -> Objective | None:
        plan, cfg = self.plan, self.cfg
        if plan.prototypes != "unit":
            return None
        if sorted(table) != list(range(plan.num_classes)):
            raise WireError(f"FedPAGR targets must hold every class 0..{plan.num_classes - 1}, got {sorted(table)}")
        rows = np.stack([table[c] for c in range(plan.num_classes)])
        P = torch.from_numpy(unit.normalize_rows(rows).astype(np.float32)).to(ctx.device)
        if fresh:
            with torch.no_grad():  # anchoring: head rows := refined prototypes, bias 0
                ctx.model.head.weight.copy_(P)
                ctx.model.head.bias.zero_()
        return PagrObjective(P, cfg.beta, cfg.lambda_e, cfg.pagr_train_head, cfg.consensus)
