"""Local training, prototype-space extraction and evaluation of one client's model (torch).

Nothing here knows about messages, transports or techniques: the agent hands in arrays and the round's
objective (edge_agent/techniques) and gets arrays back.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from edge_agent.models import ProtoNet
from protofl.config import FederationConfig

if TYPE_CHECKING:
    from edge_agent.techniques import Objective


@dataclass
class TrainStats:
    loss: float
    seconds: float
    steps: int


def batch_loss(model: ProtoNet, xb: torch.Tensor, yb: torch.Tensor, objective: Objective) -> torch.Tensor:
    """The round's objective on one batch (shared by full and frozen-backbone training)."""
    return objective.loss(model.features(xb), yb, model.head)


def train_local(
    model: ProtoNet,
    x: torch.Tensor,
    y: torch.Tensor,
    cfg: FederationConfig,
    objective: Objective,
    seed: int,
) -> TrainStats:
    """`cfg.local_epochs` epochs of SGD (lr, momentum, weight decay from cfg) on (x, y).

    A fresh optimiser each round, as in the papers' reference code; the batch order comes from
    `seed` so a run is reproducible on any transport.
    """
    frozen = cfg.backbone == "frozen"
    for p in model.backbone.parameters():
        p.requires_grad_(not frozen)
    for p in model.head.parameters():
        p.requires_grad_(not objective.fixed_head)
    params = [p for p in model.parameters() if p.requires_grad]
    model.train()
    if frozen:
        model.backbone.eval()  # frozen also means BatchNorm statistics stay put
    return sgd_epochs(model, params, x, y, cfg, objective, seed)


def sgd_epochs(model: ProtoNet, params: Sequence[torch.Tensor], x: torch.Tensor, y: torch.Tensor,
               cfg: FederationConfig, objective: Objective, seed: int) -> TrainStats:
    """The local SGD loop shared by full and frozen-backbone training: same batch order for a seed.

    `model` only needs `features` and `head` (the frozen mode passes a view that starts from cached h).
    """
    opt = SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
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
            loss = batch_loss(model, x[idx], y[idx], objective)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"local training diverged (loss {loss.item()}); lower lr")
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach())
            steps += 1
    return TrainStats(total / max(steps, 1), time.perf_counter() - start, steps)


class SGD:
    """torch.optim.SGD's update (its per-tensor path, the one it takes on CPU): weight decay, momentum with
    dampening 0, no Nesterov; the same tensor ops in the same order, so the weights agree bit for bit
    (tests/edge_agent/test_trainer_sgd.py).

    Why not torch.optim.SGD itself: its first construction in a process imports torch._dynamo (about 2 s of
    CPU, more than a small simulated round), and every simulated device pays it again over MQTT and in each
    benchmark run; its step also goes through profiling and hook wrappers on every batch.
    """

    def __init__(self, params: Sequence[torch.Tensor], lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0) -> None:
        self.params = list(params)
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.buffers: list[torch.Tensor | None] = [None] * len(self.params)  # momentum: fresh each round

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue  # as torch: a parameter the loss did not reach keeps its weights and momentum
            g = p.grad
            if self.weight_decay != 0:
                g = g.add(p, alpha=self.weight_decay)
            if self.momentum != 0:
                buf = self.buffers[i]
                if buf is None:
                    buf = self.buffers[i] = g.detach().clone()
                else:
                    buf.mul_(self.momentum).add_(g, alpha=1)  # 1 - dampening (0)
                g = buf
            p.add_(g, alpha=-self.lr)


@torch.inference_mode()
def embed(model: ProtoNet, x: torch.Tensor, batch_size: int = 512) -> np.ndarray:
    """z for every row of x, in eval mode (prototypes are computed after training, in eval mode)."""
    model.eval()
    out = [model.features(x[i : i + batch_size]) for i in range(0, int(x.shape[0]), batch_size)]
    if not out:
        return np.zeros((0, model.proto_dim), dtype=np.float32)
    return torch.cat(out).cpu().numpy().astype(np.float32, copy=False)
