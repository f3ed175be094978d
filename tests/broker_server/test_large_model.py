"""FedAvg on resnet18 (11.2 M parameters, ~45 MB a model message) runs to the end: the decoder limits
follow the round plan on both sides instead of a fixed 32 MiB that silently dropped every model."""

from __future__ import annotations

import pytest

from broker_server.simulation import SimulationSpec, run_simulation
from tests.pipelines import NO_FLOOR


@pytest.mark.slow
def test_fedavg_resnet18_round_completes(one_torch_thread: None) -> None:
    report = run_simulation(
        SimulationSpec(
            preset="fedavg",
            dataset="synthetic:n=120,n_test=8",
            clients=2,
            rounds=1,
            seed=0,
            archs=("resnet18",),
            overrides={"batch_size": 32, "public_per_class": 0, **NO_FLOOR},  # the messages' size is the point
        )
    )
    (row,) = report["rounds"]
    assert report["dropped"] == {} and row["clients"] == 2 and row["closed_by"] == "quorum"
    # two uploads of the full model, each over the old fixed limit of 32 MiB
    assert row["uplink_bytes"] > 2 * 32 * 2**20
    assert report["config"]["archs"] == ["resnet18"]
