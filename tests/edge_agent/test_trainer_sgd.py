"""trainer.SGD is torch.optim.SGD's update, bit for bit (training results must not move with it)."""

from __future__ import annotations

import pytest
import torch

from edge_agent.training.trainer import SGD


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        self.unused = torch.nn.Linear(2, 2)  # no gradient reaches it: both leave it as it is

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _model() -> _Net:
    torch.manual_seed(0)
    return _Net()


@pytest.mark.parametrize("momentum, weight_decay", [(0.9, 1e-4), (0.0, 0.0), (0.5, 0.0)])
def test_weights_match_torch_sgd_exactly(momentum: float, weight_decay: float) -> None:
    ours, ref = _model(), _model()
    opt = SGD(list(ours.parameters()), lr=0.05, momentum=momentum, weight_decay=weight_decay)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=momentum, weight_decay=weight_decay)
    gen = torch.Generator().manual_seed(1)
    for _ in range(7):
        x, y = torch.randn(32, 8, generator=gen), torch.randint(0, 3, (32,), generator=gen)
        for net, o in ((ours, opt), (ref, ref_opt)):
            o.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            o.step()
    for (name, a), (_, b) in zip(ours.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert all(p.grad is None for p in ours.unused.parameters())
