"""The federated adapter theta_a = (A_f, H) as the server sees it: a layout and a flat vector.

The server (numpy only) owns the initial global adapter, so it must know the layout without torch.
`adapter_layout` mirrors `edge_agent.training.params.adapter_layout` for `ResidualAdapter` + head; a test
checks the two agree. `initial_adapter` follows PyTorch's nn.Linear default initialisation
(U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weight and bias) and zeroes W_up as the agent's model does,
so A_f starts as the identity.
"""

from __future__ import annotations

import math

import numpy as np

Layout = list[tuple[str, tuple[int, ...]]]


def adapter_layout(proto_dim: int, rank: int, num_classes: int) -> Layout:
    m, r, c = proto_dim, rank, num_classes
    return [
        ("adapter.down.weight", (r, m)),
        ("adapter.down.bias", (r,)),
        ("adapter.up.weight", (m, r)),
        ("adapter.up.bias", (m,)),
        ("head.weight", (c, m)),
        ("head.bias", (c,)),
    ]


def layout_size(layout: Layout) -> int:
    return int(sum(math.prod(shape) for _, shape in layout))


def initial_adapter(layout: Layout, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, 0xADA])
    fan_in: dict[str, int] = {}
    for name, shape in layout:
        if name.endswith(".weight") and len(shape) == 2:
            fan_in[name.rsplit(".", 1)[0]] = shape[1]
    parts = []
    for name, shape in layout:
        module = name.rsplit(".", 1)[0]
        size = math.prod(shape)
        if module.endswith(".up"):
            parts.append(np.zeros(size, dtype=np.float32))
        else:
            bound = 1.0 / math.sqrt(fan_in.get(module, shape[-1]))
            parts.append(rng.uniform(-bound, bound, size).astype(np.float32))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)
