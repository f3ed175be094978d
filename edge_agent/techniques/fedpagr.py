"""FedPAGR's device half (paper 004, Alg. 1 on the client): unit prototypes, the consensus projection
g_k, the anchored head and the composite loss.

Each round the refined prototypes P (C x m, unit rows) arrive; the head's rows are set to P (bias 0) and
stay fixed while f_k and g_k train (`pagr_train_head` is the variant that trains it too) on

    CE(head(z_hat), y) + CE(z_hat . P^T / beta, y) + lambda_E * L_ent,      z_hat = z / ||z||,

with L_ent = -(1/|B|) sum_x (1/C) sum_c log softmax(z_hat . P^T / beta)_c, a uniformity pressure that
keeps the prototypes from collapsing onto one direction. In the composed objective (edge_agent/techniques)
the first two are this rule's classifier (the anchored head and the cosine logits, which also classify
for the metrics: argmax_c z_hat . P_c) and the entropy its loss term. The upload is eq. (2)'s unit class
means. The server half (consensus, refinement) is protofl/algorithms/fedpagr.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from edge_agent.techniques import Batch, Classifier, DeviceContext, DeviceRule, LossTerm, Objective
from edge_agent.training.models import softmax_rows
from protofl.algorithms import unit
from protofl.errors import WireError


def entropy_regulariser(proto_logits: torch.Tensor) -> torch.Tensor:
    """L_ent = -(1/|B|) sum_x (1/C) sum_c log softmax(logits)_c."""
    return -F.log_softmax(proto_logits, dim=1).mean(dim=1).mean()


def fedpagr_loss(
    z: torch.Tensor, y: torch.Tensor, head: torch.nn.Module, prototypes: torch.Tensor, beta: float, lambda_e: float
) -> torch.Tensor:
    """CE(head(z_hat), y) + CE((z_hat . P^T) / beta, y) + lambda_E * L_ent, with z_hat = z/||z||."""
    z_hat = F.normalize(z, dim=1)
    proto_logits = z_hat @ prototypes.t() / beta
    return (
        F.cross_entropy(head(z_hat), y)
        + F.cross_entropy(proto_logits, y)
        + lambda_e * entropy_regulariser(proto_logits)
    )


def cosine_probabilities(z: np.ndarray, P: torch.Tensor | np.ndarray, beta: float) -> np.ndarray:
    """(n, C) class probabilities softmax(z_hat . P^T / beta) from features z and unit prototypes P, in numpy."""
    if isinstance(P, torch.Tensor):
        P = P.detach().cpu().numpy()
    P = np.ascontiguousarray(P, dtype=np.float32)
    if len(z) == 0:
        return np.zeros((0, P.shape[0]), dtype=np.float32)
    z_hat = z / np.maximum(np.linalg.norm(z, axis=1, keepdims=True), 1e-12)  # F.normalize's eps
    return softmax_rows(z_hat @ P.T / np.float32(beta))


class CosineClassifier(Classifier):
    """The anchored head on z_hat and the cosine logits z_hat . P^T / beta, each with cross-entropy; with
    the consensus projection the metrics classify by cosine to P (softmax of the cosine logits)."""

    def __init__(self, P: torch.Tensor, beta: float, train_head: bool, cosine: bool) -> None:
        self.P, self.beta, self.cosine = P, beta, cosine
        self.fixed_head = not train_head
        self.metric = "cosine" if cosine else None

    def batch(self, z: torch.Tensor, y: torch.Tensor, head: torch.nn.Module) -> Batch:
        z_hat = F.normalize(z, dim=1)
        return Batch(z=z, y=y, head=head, head_input=z_hat, prototype_logits=z_hat @ self.P.t() / self.beta)

    def loss(self, batch: Batch) -> torch.Tensor:
        assert batch.prototype_logits is not None
        return F.cross_entropy(batch.head(batch.head_input), batch.y) + F.cross_entropy(batch.prototype_logits, batch.y)

    def probabilities(self, model: Any, z: np.ndarray) -> np.ndarray:
        return cosine_probabilities(z, self.P, self.beta) if self.cosine else super().probabilities(model, z)

    def nearest_correct(self, z: np.ndarray, y: np.ndarray, probs: np.ndarray) -> int | None:
        # softmax(cos(z, P) / beta) has the nearest prototype by cosine as its argmax.
        if not self.cosine:
            return None
        return int((probs.argmax(1) == y).sum()) if len(probs) else 0

    def table(self) -> dict[int, np.ndarray]:
        P = self.P.detach().cpu().numpy()
        return {c: P[c] for c in range(P.shape[0])}


class EntropyTerm(LossTerm):
    """lambda_E * L_ent on the cosine logits of the batch."""

    def __init__(self, lambda_e: float) -> None:
        self.lambda_e = lambda_e

    def loss(self, batch: Batch) -> torch.Tensor:
        assert batch.prototype_logits is not None, "the entropy term needs FedPAGR's cosine classifier"
        return self.lambda_e * entropy_regulariser(batch.prototype_logits)


def pagr_objective(P: torch.Tensor, beta: float, lambda_e: float, train_head: bool, cosine: bool) -> Objective:
    """The composite loss against P as an objective (what `fedpagr_loss` computes, term for term)."""
    return Objective(CosineClassifier(P, beta, train_head, cosine), (EntropyTerm(lambda_e),))


class FedPagrDevice(DeviceRule):
    name = "fedpagr"

    def model_options(self) -> dict[str, Any]:
        return {"projection": bool(self.cfg.consensus)}

    def local_prototypes(
        self, z: np.ndarray, y: np.ndarray
    ) -> tuple[dict[int, np.ndarray], dict[int, int] | None] | None:
        if self.plan.prototypes != "unit":
            return None
        return unit.client_prototypes(z, y, self.plan.num_classes), None

    def _prototypes(self, ctx: DeviceContext, table: dict[int, np.ndarray]) -> torch.Tensor | None:
        """P (C x m, unit rows) from the round's targets; None without any or without unit prototypes."""
        plan = self.plan
        if plan.prototypes != "unit" or not table:
            return None
        if sorted(table) != list(range(plan.num_classes)):
            raise WireError(f"FedPAGR targets must hold every class 0..{plan.num_classes - 1}, got {sorted(table)}")
        rows = np.stack([table[c] for c in range(plan.num_classes)])
        return torch.from_numpy(unit.normalize_rows(rows).astype(np.float32)).to(ctx.device)

    def classifier(self, ctx: DeviceContext, table: dict[int, np.ndarray], fresh: bool) -> Classifier | None:
        P = self._prototypes(ctx, table)
        if P is None:
            return None
        if fresh:
            with torch.no_grad():  # anchoring: head rows := refined prototypes, bias 0
                ctx.model.head.weight.copy_(P)
                ctx.model.head.bias.zero_()
        cfg = self.cfg
        return CosineClassifier(P, cfg.beta, cfg.pagr_train_head, cfg.consensus)

    def loss_terms(self, ctx: DeviceContext, table: dict[int, np.ndarray], fresh: bool) -> Sequence[LossTerm]:
        if self.plan.prototypes != "unit" or not table:
            return ()
        return (EntropyTerm(self.cfg.lambda_e),)
