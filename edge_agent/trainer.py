"""Local training, prototype-space extraction and evaluation of one client's model (torch).

Nothing here knows about messages or transports: the agent hands in arrays and targets and gets
arrays back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from edge_agent import losses
from edge_agent.models import ProtoNet
from protofl.config import FederationConfig
from protofl.plan import TargetKind


@dataclass
class Targets:
    """What the prototype term aligns z to this round (the round plan's target kind).

    values: (C, m) float tensor; present: (C,) bool tensor (classes that have a target).
    """

    kind: TargetKind = TargetKind.NONE
    values: torch.Tensor | None = None
    present: torch.Tensor | None = None

    @classmethod
    def from_table(cls, kind: TargetKind, table: dict[int, np.ndarray], num_classes: int, dim: int,
                   device: torch.device | str = "cpu") -> "Targets":
        values = torch.zeros(num_classes, dim)
        present = torch.zeros(num_classes, dtype=torch.bool)
        for c, v in table.items():
            values[c] = torch.from_numpy(np.asarray(v, dtype=np.float32))
            present[c] = True
        return cls(kind, values.to(device), present.to(device))


@dataclass
class TrainStats:
    loss: float
    seconds: float
    steps: int


def batch_loss(model: ProtoNet, xb: torch.Tensor, yb: torch.Tensor, cfg: FederationConfig, targets: Targets) -> torch.Tensor:
    """The preset's training objective on one batch (shared by full and frozen-backbone training)."""
    z = model.features(xb)
    if targets.kind is TargetKind.PAGR:
        assert targets.values is not None
        return losses.fedpagr_loss(z, yb, model.head, targets.values, cfg.beta, cfg.lambda_e)
    loss = F.cross_entropy(model.head(z), yb)
    if targets.kind in (TargetKind.MSE, TargetKind.ANCHOR):
        loss = loss + cfg.proto_lambda * losses.alignment(z, yb, targets.values, targets.present)
    return loss


def head_is_fixed(cfg: FederationConfig, targets: Targets) -> bool:
    """FedPAGR's anchored head (rows = refined prototypes) is not trained during the round (Alg. 1 line 14
    updates only f_k and g_k), unless `pagr_train_head` asks for the variant."""
    return targets.kind is TargetKind.PAGR and not cfg.pagr_train_head


def train_local(
    model: ProtoNet,
    x: torch.Tensor,
    y: torch.Tensor,
    cfg: FederationConfig,
    targets: Targets,
    seed: int,
) -> TrainStats:
    """`cfg.local_epochs` epochs of SGD (lr, momentum, weight decay from cfg) on (x, y).

    A fresh optimiser each round, as in the papers' reference code; the batch order comes from
    `seed` so a run is reproducible on any transport.
    """
    frozen = cfg.backbone == "frozen"
    for p in model.backbone.parameters():
        p.requires_grad_(not frozen)
    fixed_head = head_is_fixed(cfg, targets)
    for p in model.head.parameters():
        p.requires_grad_(not fixed_head)
    params = [p for p in model.parameters() if p.requires_grad]
    model.train()
    if frozen:
        model.backbone.eval()  # frozen also means BatchNorm statistics stay put
    return sgd_epochs(model, params, x, y, cfg, targets, seed)


def sgd_epochs(model: ProtoNet, params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor,
               cfg: FederationConfig, targets: Targets, seed: int) -> TrainStats:
    """The local SGD loop shared by full and frozen-backbone training: same batch order for a seed.

    `model` only needs `features` and `head` (the frozen mode passes a view that starts from cached h).
    """
    opt = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    rng = np.random.default_rng(seed)
    n = int(x.shape[0])
    total, steps = 0.0, 0
    start = time.perf_counter()
    for _ in range(cfg.local_epochs):
        order = torch.from_numpy(rng.permutation(n))
        for i in range(0, n, cfg.batch_size):
            idx = order[i : i + cfg.batch_size]
            if idx.numel() < 2:
                continue  # BatchNorm cannot train on a single sample
            loss = batch_loss(model, x[idx], y[idx], cfg, targets)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"local training diverged (loss {loss.item()}); lower lr")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += float(loss.detach())
            steps += 1
    return TrainStats(total / max(steps, 1), time.perf_counter() - start, steps)


@torch.inference_mode()
def embed(model: ProtoNet, x: torch.Tensor, batch_size: int = 512) -> np.ndarray:
    """z for every row of x, in eval mode (prototypes are computed after training, in eval mode)."""
    model.eval()
    out = [model.features(x[i : i + batch_size]) for i in range(0, int(x.shape[0]), batch_size)]
    if not out:
        return np.zeros((0, model.proto_dim), dtype=np.float32)
    return torch.cat(out).cpu().numpy().astype(np.float32, copy=False)
