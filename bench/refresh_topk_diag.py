"""Issue 56 diagnostic (PREDICTOR.md "Full data", "Why refresh falls short"): where refresh's top-K lands on one
device's update (setting A, seed 0, 6,000 images, the cached public model of fulldata-cpu/A), and what that
device's top-K does to g. Not a benchmark row.

    PYTHONPATH=. OMP_NUM_THREADS=1 python bench/refresh_topk_diag.py
"""

# mypy: ignore-errors
import copy
import time

import numpy as np
import torch

from bench import predictor_routes as pr
from edge_agent.training.models import build_model
from protofl.data.loaders import load_fashion_mnist

torch.set_num_threads(1)
t0 = time.time()
train_full, test = load_fashion_mnist(None)
keep = pr.limit_train_idx(len(train_full), 6000, 0)
train = train_full.subset(keep)
split = pr.federation(train.y, 10, 0.5, 0)
x = train.normalized()
m = build_model("cnn", pr.IN_SHAPE, 10, 512, 32, seed=0)
m.load_state_dict(
    torch.load("bench/results/predictor/fulldata-cpu/A/cache/public-cnn-s0-tl6000-e60.pt", weights_only=False)["state"]
)
m.eval()
G = B = None
cl = []
with torch.no_grad():
    for c in split.clients:
        xc = torch.from_numpy(np.ascontiguousarray(x[c.train], np.float32))
        yc = train.y[c.train]
        h = m.features(xc).numpy()
        g, b = pr.ridge_stats(h, yc, 10)
        G = g if G is None else G + g
        B = b if B is None else B + b
        cl.append((xc, torch.from_numpy(yc)))
w, b = pr.ridge_solve(G, B)
with torch.no_grad():
    m.head.weight.copy_(torch.from_numpy(w))
    m.head.bias.copy_(torch.from_numpy(b))
tx = torch.from_numpy(np.ascontiguousarray(test.normalized()[:2000], np.float32))
ty = torch.from_numpy(test.y[:2000])


def acc(mod):
    with torch.no_grad():
        return 100 * float((mod(tx).argmax(1) == ty).float().mean())


with torch.no_grad():
    lg = m(tx)
    p = torch.softmax(lg, 1)
print(
    f"ridge head: acc {acc(m):.2f}; logits mean max {lg.max(1).values.mean():.3f}, softmax max mean {p.max(1).values.mean():.3f}, CE {torch.nn.functional.cross_entropy(lg, ty):.3f}; |W| {np.abs(w).mean():.4f}"  # noqa: E501
)
names = [n for n, t in m.state_dict().items() if t.is_floating_point()]
sizes = [m.state_dict()[n].numel() for n in names]
gvec = torch.cat([m.state_dict()[n].reshape(-1) for n in names]).clone()

k = 3
work = copy.deepcopy(m)
work.train()
opt = torch.optim.SGD(work.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
xc, yc = cl[k]
perm = torch.from_numpy(np.random.default_rng(0).permutation(len(yc)))
for i in range(0, len(yc), 64):
    idx = perm[i : i + 64]
    loss = torch.nn.functional.cross_entropy(work(xc[idx]), yc[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
delta = torch.cat([work.state_dict()[n].reshape(-1) for n in names]) - gvec
K = pr.topk_count(len(gvec), 0.001)
idx = torch.topk(delta.abs(), K).indices
bounds = np.cumsum([0] + sizes)
counts = {n: int(((idx >= bounds[i]) & (idx < bounds[i + 1])).sum()) for i, n in enumerate(names)}
print("K", K, "top-K entries per tensor:", {n: c for n, c in counts.items() if c})
print(
    "|delta| mean per tensor:", {n: float(delta[bounds[i] : bounds[i + 1]].abs().mean()) for i, n in enumerate(names)}
)


def with_delta(d):
    mm = copy.deepcopy(m)
    v = gvec + d
    at = 0
    with torch.no_grad():
        for n in names:
            t = mm.state_dict()[n]
            t.copy_(v[at : at + t.numel()].view_as(t))
            at += t.numel()
    mm.eval()
    return acc(mm)


sent = torch.zeros_like(delta)
sent[idx] = delta[idx]
print(
    f"client {k} ({len(yc)} images, classes {np.bincount(yc.numpy(), minlength=10).tolist()}): g {acc(m):.2f}; g + its whole update {with_delta(delta):.2f}; g + its top-K {with_delta(sent):.2f}; g + 0.198 x top-K (its weight) {with_delta(0.198 * sent):.2f}"  # noqa: E501
)
print("wall", time.time() - t0)
