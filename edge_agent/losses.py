"""Client-side training losses (torch), one function per paper's objective.

- `fedproto_mse`: FedProto (Tan et al. 2022) regulariser, lambda * MSE(z, g_y); TinyProto uses the
  same term with the structured-sparse (CPS) target, which pushes off-mask dims of z to zero.
- `anchor_alignment`: RefProtoFL eq. 17, squared L2 distance to the ERPA anchor a_y, averaged over
  the batch (eq. 17 sums over samples; a per-batch mean keeps lambda independent of batch size).
- `fedpagr_loss`: FedPAGR composite loss: CE(head(z_hat)) + CE(z_hat P^T / beta) + lambda_E L_ent.
Samples whose class has no target contribute no prototype term.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fedproto_mse(z: torch.Tensor, y: torch.Tensor, targets: torch.Tensor, has_target: torch.Tensor) -> torch.Tensor:
    """Mean squared error between z and its class target, over the samples that have a target.

    targets: (C, m); has_target: (C,) bool. PFLlib/FedProto use nn.MSELoss, i.e. mean over elements.
    """
    keep = has_target[y]
    if not bool(keep.any()):
        return z.new_zeros(())
    return F.mse_loss(z[keep], targets[y[keep]])


def anchor_alignment(z: torch.Tensor, y: torch.Tensor, anchors: torch.Tensor, has_anchor: torch.Tensor) -> torch.Tensor:
    """RefProtoFL eq. 17: mean over the batch of ||z - a_y||^2; samples with no anchor add zero."""
    keep = has_anchor[y].to(z.dtype)
    sq = ((z - anchors[y]) ** 2).sum(dim=1)
    return (sq * keep).sum() / z.shape[0]


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
