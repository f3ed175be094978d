"""Client-side training losses (torch), one function per paper's objective.

- `alignment`: the one prototype-alignment term A(z, a) of every method (ALGORITHMS.md, "One alignment
  term"): the per-element squared error to the class target, mean over the batch and the m dims. FedProto
  aligns to g_y, TinyProto to the structured-sparse (CPS) target (which pushes off-mask dims of z to 0),
  RefProtoFL to the ERPA anchor a_y (its eq. 17 writes a sum over dims; on that scale lambda = 1 is 512x
  the cross-entropy and training collapsed to chance, so every method uses the MSE scale).
- `fedpagr_loss`: FedPAGR composite loss: CE(head(z_hat)) + CE(z_hat P^T / beta) + lambda_E L_ent.
Samples whose class has no target contribute no prototype term.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def alignment(z: torch.Tensor, y: torch.Tensor, targets: torch.Tensor, has_target: torch.Tensor) -> torch.Tensor:
    """A(z, a) = (1/|B|) sum_i (1/m) ||z_i - a_{y_i}||^2 over the batch B; a sample whose class has no
    target adds zero but still counts in |B| (FedProto's reference code uses z itself as the target there),
    so the term's weight does not depend on how many classes have targets.

    targets: (C, m); has_target: (C,) bool.
    """
    keep = has_target[y].to(z.dtype)
    per_sample = ((z - targets[y]) ** 2).mean(dim=1)
    return (per_sample * keep).sum() / z.shape[0]


def entropy_regulariser(proto_logits: torch.Tensor) -> torch.Tensor:
    """FedPAGR L_ent = -(1/|B|) sum_x (1/C) sum_c log softmax(z_hat . P^T / beta)_c.

    Minimising it keeps every class's probability away from zero (a uniformity pressure that keeps
    the prototypes from collapsing onto one direction).
    """
    return -F.log_softmax(proto_logits, dim=1).mean(dim=1).mean()


def fedpagr_loss(
    z: torch.Tensor,
    y: torch.Tensor,
    head: torch.nn.Linear,
    prototypes: torch.Tensor,
    beta: float,
    lambda_e: float,
) -> torch.Tensor:
    """FedPAGR: CE(head(z_hat), y) + CE((z_hat . P^T) / beta, y) + lambda_E * L_ent, with z_hat = z/||z||."""
    z_hat = F.normalize(z, dim=1)
    proto_logits = z_hat @ prototypes.t() / beta
    return (
        F.cross_entropy(head(z_hat), y)
        + F.cross_entropy(proto_logits, y)
        + lambda_e * entropy_regulariser(proto_logits)
    )
