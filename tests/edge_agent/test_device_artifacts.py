"""A device's deployable artifacts (edge_agent/core/artifacts.py): a device that joins late can predict before it
trains, and what it ends with is kept when the federation finishes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from edge_agent.training.models import build_model
from export.checkpoint import load_model
from protofl import artifacts as art
from protofl.wire import ProtoSet, RoundStart
from tests.edge_agent.test_agent import setup, start_round


def test_a_late_joiner_has_deployable_artifacts_before_it_trains_and_after_the_end(tmp_path: Path) -> None:
    seen: list[tuple[int, str]] = []

    def deployable(arts) -> None:  # what join --state-dir does (edge_agent/ops/runner.py), recorded
        out = arts.write(tmp_path, ["cat", "dog", "owl"], data="npz:mine.npz")
        seen.append((arts.rounds_trained, art.read_prototypes(out / art.PROTOTYPES).source))

    cfg, broker, server, agent, uploads = setup("fedproto", on_artifacts=deployable)
    targets = {0: np.full(16, 0.5, np.float32), 1: np.full(16, -0.5, np.float32)}
    # It joins in round 3: the round message carries the federation's global prototypes.
    start_round(
        broker, server, 3, RoundStart(deadline=0.0, targets=ProtoSet.from_table(targets, 16), target_label="dense")
    )
    assert seen == [(0, "global")]  # written before its first local training
    start_round(broker, server, 4, RoundStart(deadline=0.0, final=True), phase="done")
    assert seen == [(0, "global"), (1, "global")]  # and again with what it ends with

    d = art.device_dir(tmp_path, "dev1")
    protos = art.read_prototypes(d / art.PROTOTYPES)
    assert protos.metric == "l2" and protos.class_names == ("cat", "dog")
    assert np.array_equal(protos.table()[0], targets[0])  # the global prototypes as the device decodes them
    local = art.read_prototypes(d / art.LOCAL)
    assert local.source == "local" and local.classes.tolist() == [0, 1]  # its own class means, full width
    assert local.values.shape == (2, cfg.proto_dim)
    info = art.read_json(d / art.DEVICE)
    assert info["rounds_trained"] == 1 and info["data"] == "npz:mine.npz" and info["config"] == cfg.to_dict()
    # The export tools rebuild its model from the file alone: the trained weights, not the initial ones.
    model = load_model(None, d / art.MODEL)
    assert model.arch == "mlp" and model.in_shape == (1, 6, 6)
    for (k, a), (_, b) in zip(model.state_dict().items(), agent.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    initial = build_model("mlp", (1, 6, 6), 3, 16, 2, seed=cfg.seed)
    assert not torch.equal(model.head.weight, initial.head.weight)


def test_without_targets_a_device_classifies_by_its_own_class_means(tmp_path: Path) -> None:
    cfg, broker, server, agent, uploads = setup("fedavg", on_artifacts=lambda arts: arts.write(tmp_path))
    start_round(broker, server, 1, RoundStart(deadline=0.0))
    protos = art.read_prototypes(art.device_dir(tmp_path, "dev1") / art.PROTOTYPES)
    assert protos.source == "local" and protos.metric == "l2" and protos.classes.tolist() == [0, 1]
