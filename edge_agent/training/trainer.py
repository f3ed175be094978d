"""Local training, prototype-space extraction and evaluation of one client's model (torch).

Nothing here knows about messages, transports or techniques: the agent hands in arrays and the round's
objective (edge_agent/techniques) and gets arrays back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from edge_agent.training.models import ProtoNet
from protofl.config import FederationConfig
from protofl.data.dataset import Images

if TYPE_CHECKING:
    from edge_agent.techniques import Objective


@dataclass
class TrainStats:
    loss: float
    seconds: float
    steps: int
    # With cfg.proto_source == "during": the features z of every sample a step trained on, as that step saw
    # them (train mode, before its update), and their labels: PFLlib's FedProto averages these into the
    # uploaded prototypes. None otherwise (the prototypes come from the trained model in eval mode).
    seen: tuple[np.ndarray, np.ndarray] | None = None


# Rows per forward pass when features are extracted (prototypes, metrics): eval mode makes z independent of the
# batch, and 64 rows peak ~90 MB lower than 512 on the cnn (bench/results/FOOTPRINT.md) for the same time.
EMBED_BATCH = 64

# A device's inputs: a tensor (normalised, on the model's device), a normalised float32 array, or its uint8 images
# normalised a batch at a time (protofl.data.dataset.Images: how `join` holds its data).
Inputs = torch.Tensor | np.ndarray | Images


def rows(x: Inputs, index: slice | torch.Tensor, device: torch.device) -> torch.Tensor:
    """x's rows at `index` (a slice, or a tensor of row numbers) as a float32 tensor on `device`."""
    if isinstance(x, torch.Tensor):
        return x[index]
    at = index.cpu().numpy() if isinstance(index, torch.Tensor) else index
    return torch.from_numpy(np.ascontiguousarray(x[at], dtype=np.float32)).to(device)


# Momentum buffers kept between rounds (cfg.keep_optimizer), by parameter name; the agent holds them.
Momentum = dict[str, torch.Tensor]


def train_local(
    model: ProtoNet,
    x: Inputs,
    y: torch.Tensor,
    cfg: FederationConfig,
    objective: Objective,
    seed: int,
    momentum: Momentum | None = None,
) -> TrainStats:
    """`cfg.local_epochs` epochs of SGD (lr, momentum, weight decay from cfg) on (x, y), continued into more epochs
    until `cfg.min_local_steps` steps (the step floor: the last epoch may stop part way).

    A fresh optimiser each round, as in the papers' reference code, unless `momentum` is given (the
    buffers of the previous round, cfg.keep_optimizer: PFLlib makes one optimiser per client for the whole
    run); it is updated in place. The batch order comes from `seed` so a run is reproducible on any transport.
    """
    frozen = cfg.backbone == "frozen"
    for p in model.backbone.parameters():
        p.requires_grad_(not frozen)
    for p in model.head.parameters():
        p.requires_grad_(not objective.fixed_head)
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    model.train()
    if frozen:
        model.backbone.eval()  # frozen also means BatchNorm statistics stay put
    return sgd_epochs(
        model, [p for _, p in named], x, y, cfg, objective, seed, momentum=momentum, names=[name for name, _ in named]
    )


def sgd_epochs(
    model: ProtoNet,
    params: Sequence[torch.Tensor],
    x: Inputs,
    y: torch.Tensor,
    cfg: FederationConfig,
    objective: Objective,
    seed: int,
    momentum: Momentum | None = None,
    names: Sequence[str] | None = None,
) -> TrainStats:
    """The local SGD loop shared by full and frozen-backbone training: same batch order for a seed.

    `model` only needs `features` and `head` (the frozen mode passes a view that starts from cached h).
    `momentum` (with the parameters' `names`): buffers to start from and to leave this round's in.
    `cfg.drop_last` skips each epoch's last incomplete batch (PFLlib's DataLoader(drop_last=True)).
    """
    opt = SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if momentum is not None:
        if names is None or len(names) != len(opt.params):
            raise ValueError("kept momentum needs one name per trained parameter")
        opt.buffers = [momentum.get(name) for name in names]
    rng = np.random.default_rng(seed)
    n = int(x.shape[0])
    collect = cfg.proto_source == "during"
    seen_z: list[torch.Tensor] = []
    seen_y: list[torch.Tensor] = []
    total, steps = 0.0, 0
    start = time.perf_counter()
    epoch = 0
    while epoch < cfg.local_epochs or (steps < cfg.min_local_steps and steps > 0):
        # whole epochs, then (cfg.min_local_steps, the step floor of small sets) more epochs until the floor: the
        # last one may stop part way. A set that gives no step at all (fewer than 2 samples) stops after the first.
        epoch += 1
        order = torch.from_numpy(rng.permutation(n))
        for i in range(0, n, cfg.batch_size):
            if epoch > cfg.local_epochs and steps >= cfg.min_local_steps:
                break
            idx = order[i : i + cfg.batch_size]
            if idx.numel() < 2 or (cfg.drop_last and idx.numel() < cfg.batch_size):
                continue  # BatchNorm cannot train on a single sample; drop_last: a short batch
            z = model.features(rows(x, idx, y.device))
            loss = objective.loss(z, y[idx], model.head)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"local training diverged (loss {loss.item()}); lower lr")
            if collect:
                seen_z.append(z.detach().clone())
                seen_y.append(y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach())
            steps += 1
    if momentum is not None:
        assert names is not None
        momentum.update({name: buf for name, buf in zip(names, opt.buffers, strict=True) if buf is not None})
    seen = None
    if collect:
        zs = torch.cat(seen_z).cpu().numpy() if seen_z else np.zeros((0, model.head.in_features), np.float32)
        ys = torch.cat(seen_y).cpu().numpy() if seen_y else np.zeros(0, np.int64)
        seen = (zs.astype(np.float32, copy=False), ys.astype(np.int64, copy=False))
    return TrainStats(total / max(steps, 1), time.perf_counter() - start, steps, seen)


class SGD:
    """torch.optim.SGD's update (its per-tensor path, the one it takes on CPU): weight decay, momentum with
    dampening 0, no Nesterov; the same tensor ops in the same order, so the weights agree bit for bit
    (tests/edge_agent/test_trainer_sgd.py).

    Why not torch.optim.SGD itself: its first construction in a process imports torch._dynamo (about 2 s of
    CPU, more than a small simulated round), and every simulated device pays it again over MQTT and in each
    benchmark run; its step also goes through profiling and hook wrappers on every batch.
    """

    def __init__(
        self, params: Sequence[torch.Tensor], lr: float, momentum: float = 0.0, weight_decay: float = 0.0
    ) -> None:
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
def embed(
    model: ProtoNet,
    x: Inputs,
    batch_size: int = EMBED_BATCH,
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> np.ndarray:
    """z for every row of x, in eval mode (prototypes are computed after training, in eval mode), `batch_size`
    rows at a time (`transform`: applied to each batch of inputs first)."""
    model.eval()
    device = next(model.parameters()).device
    out: np.ndarray | None = None  # filled a batch at a time: the features are never held twice
    n = len(x)
    for i in range(0, n, batch_size):
        xb = rows(x, slice(i, i + batch_size), device)
        z = model.features(xb if transform is None else transform(xb)).cpu().numpy()
        if out is None:
            out = np.empty((n, *z.shape[1:]), dtype=z.dtype)
        out[i : i + len(z)] = z
    if out is None:
        return np.zeros((0, model.proto_dim), dtype=np.float32)
    return out.astype(np.float32, copy=False)
