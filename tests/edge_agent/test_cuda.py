"""Agents on CUDA (a Jetson, an x86 GPU box): one round of every preset with the agents on the GPU.

Skipped, saying so, on a machine without CUDA: there the CUDA path is not exercised at all.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from broker_server.core.shell import Aggregator  # noqa: E402
from edge_agent.core.agent import ClientData, EdgeAgent  # noqa: E402
from edge_agent.ops.local import LocalDevice  # noqa: E402
from protofl.data import make_synthetic  # noqa: E402
from protofl.presets import PRESETS, make_config  # noqa: E402
from protofl.transport import InProcessBroker  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device on this machine: the agents' CUDA path was not exercised"
)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_one_round_of_every_preset_with_agents_on_cuda(preset: str) -> None:
    train, test = make_synthetic(num_classes=4, n_train=240, n_test=40, seed=1)
    cfg = make_config(
        preset,
        num_classes=4,
        in_shape=tuple(train.in_shape),
        rounds=1,
        min_clients=2,
        public_per_class=0 if preset != "refprotofl" else 5,
    )
    broker = InProcessBroker()
    clients = ["g0", "g1"]
    public = None
    if cfg.erpa:
        from protofl.wire import PublicSet

        idx = np.arange(20)
        public = PublicSet(x=train.x[idx], y=train.y[idx].astype(np.int64), classes=sorted(set(train.y[idx].tolist())))
    agg = Aggregator(cfg, "cuda", broker.connect("server"), public=public, expected_clients=clients)
    agents = []
    for i, cid in enumerate(clients):
        part = np.arange(20 + i * 110, 20 + (i + 1) * 110)
        data = ClientData(
            x_train=train.normalized(part[:80]),
            y_train=train.y[part[:80]],
            x_test=train.normalized(part[80:]),
            y_test=train.y[part[80:]],
            x_global=test.normalized(),
            y_global=test.y,
        )
        agents.append(EdgeAgent(cid, "cuda", data, device="cuda"))
    agg.start()
    for a in agents:
        LocalDevice(a, broker.connect(a.client_id)).start()
    broker.pump()
    assert agg.finished, (
        f"stalled in round {agg.round}: server dropped {agg.dropped}, "
        f"agents dropped {[a.stats.dropped for a in agents]}"
    )
    assert agg.records[0].clients == clients
    assert all(a.model is not None and next(a.model.parameters()).is_cuda for a in agents)
