"""A device's deployable artifacts (torch; the layout is protofl/artifacts.py).

What a device ends with, in the form the export tools read: its model (state_dict and how to rebuild it,
with the input normalisation it was trained on), the prototype table it classifies with, and its own class
means at full width. `join --state-dir DIR` writes them to DIR/artifacts/devices/<id>/ when the federation
finishes (and when the device leaves having trained); `simulate --out DIR` for every simulated device.

The table it classifies with is the one its metrics call "nearest global prototype": the round's dense
targets as this device decodes them (expanded from their masks, rescaled where the technique rescales),
with the objective's metric. Where its technique has none (FedAvg, or a round before any target) it is
the device's own class means, as TinyProto's nearest-local-prototype rule uses them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edge_agent.training import trainer
from edge_agent.training.models import ProtoNet
from protofl import artifacts as art
from protofl.algorithms.prototypes import local_prototypes
from protofl.config import FederationConfig
from protofl.errors import DataError
from protofl.technique import first_answer

if TYPE_CHECKING:
    from edge_agent.core.agent import EdgeAgent

log = logging.getLogger("protofl.edge")

__all__ = ["DeviceArtifacts", "collect_device_artifacts", "model_spec", "write_device_artifacts"]


def model_spec(
    model: ProtoNet, mean: Sequence[float] | None = None, std: Sequence[float] | None = None
) -> dict[str, Any]:
    """What rebuilds `model` (export/checkpoint.py's ModelSpec) and the normalisation its inputs had."""
    spec: dict[str, Any] = {
        "arch": model.arch,
        "in_shape": list(model.in_shape),
        "num_classes": model.num_classes,
        "proto_dim": model.proto_dim,
        "adapter_rank": model.adapter.rank,
        "projection": model.projection is not None,
    }
    if mean is not None and std is not None:
        spec["norm_mean"], spec["norm_std"] = [float(v) for v in mean], [float(v) for v in std]
    return spec


def _own_prototypes(agent: EdgeAgent) -> tuple[dict[int, np.ndarray], dict[int, int], str]:
    """This device's class means through its current model: (table, counts, metric)."""
    assert agent.model is not None and agent.plan is not None
    z = trainer.embed(agent.model, agent.data.x_train)
    y = agent.data.y_train
    found = agent.local_prototypes(z, y)  # the technique's own kind (unit prototypes, ...)
    table, counts = found if found is not None else local_prototypes(z, y, agent.plan.num_classes)
    if counts is None:
        counts = {int(c): int((y == c).sum()) for c in table}
    return table, counts, "cosine" if agent.plan.prototypes == "unit" else "l2"


@dataclass(frozen=True)
class DeviceArtifacts:
    """What a device could deploy at one moment, copied out of it (the agent goes on training): its model, its
    own class means and the prototype table it classifies with. `write` puts it on disk."""

    client_id: str
    fed: str
    cfg: FederationConfig
    arch: str
    rounds_trained: int
    state: dict[str, np.ndarray]  # the model's state_dict, copied
    spec: dict[str, Any]  # model_spec: how to rebuild it, with its input normalisation
    own: dict[int, np.ndarray]  # its own class means through the model, full width
    counts: dict[int, int]
    own_metric: str
    targets: dict[int, np.ndarray]  # the round's dense targets as this device decodes them (empty: none)
    metric: str | None  # how the objective compares features with them (None: it classifies with the head)
    final: bool = False  # the federation had finished
    # The federation's global predictor, where the final round message carried one: its head (W, b) and the shared
    # backbone it sits on (None: the seeded initial model); written as predictor.npz beside the device's model.
    predictor: tuple[np.ndarray, np.ndarray] | None = None
    backbone: np.ndarray | None = None
    backbone_norm: tuple[list[float], list[float]] | None = None

    def write(
        self, root: str | os.PathLike[str], class_names: Sequence[str] | None = None, data: str | None = None
    ) -> Path:
        """Write ROOT/devices/<id>/; returns that folder. `data`: the spec of its data (`--data`), recorded so
        that the export tools can default to the same inputs."""
        cfg, own, counts, own_metric = self.cfg, self.own, self.counts, self.own_metric
        out = art.device_dir(root, self.client_id)
        names = list(cfg.class_names or class_names or [str(i) for i in range(cfg.num_classes)])
        art.write_model(out / art.MODEL, self.state, self.spec)
        art.write_prototypes(out / art.LOCAL, own, metric=own_metric, class_names=names, source="local", counts=counts)
        targets, metric = self.targets, self.metric
        if targets and metric is not None:
            table = {int(c): np.asarray(v, np.float32) for c, v in targets.items()}
            art.write_prototypes(out / art.PROTOTYPES, table, metric=metric, class_names=names, source="global")
            source = "global"
        else:
            art.write_prototypes(out / art.PROTOTYPES, own, metric=own_metric, class_names=names, source="local")
            source, metric = "local", own_metric
        if self.predictor is not None:
            info: dict[str, Any] = {
                "kind": "global",
                "backbone": "shipped" if self.backbone is not None else "seeded initial model",
            }
            if self.backbone_norm is not None:
                info.update(norm_mean=self.backbone_norm[0], norm_std=self.backbone_norm[1])
            art.write_predictor(out / art.PREDICTOR, self.predictor[0], self.predictor[1], self.backbone, info)
        art.write_json(
            out / art.DEVICE,
            art.stamp(
                written_by="protofl-edge join",
                client_id=self.client_id,
                fed=self.fed,
                preset=cfg.preset,
                rounds_trained=self.rounds_trained,
                arch=self.arch,
                config=cfg.to_dict(),
                class_names=names,
                data=data,
                csv_scaling=csv_scaling_of(data),
                prototypes={
                    "source": source,
                    "metric": metric,
                    "classes": sorted(int(c) for c in (targets if source == "global" else own)),
                },
            ),
        )
        return out


def csv_scaling_of(data: str | None) -> dict[str, Any] | None:
    """The per-column standardisation a ``csv:`` data spec trains with (None for other data, or a CSV taken as
    it is): recorded in device.json, carried into an ONNX export's metadata, applied by predict."""
    from protofl.data import own

    kind, sep, arg = (data or "").partition(":")
    if not sep or kind.strip().lower() != "csv":
        return None
    try:
        return own.csv_scaling(arg)
    except DataError as exc:  # the file moved since training: the artifacts still matter more
        log.warning("cannot record the csv scaling of %s: %s", data, exc)
        return None


def collect_device_artifacts(agent: EdgeAgent) -> DeviceArtifacts:
    """`agent`'s deployable artifacts now (configured: it holds a model)."""
    model, cfg = agent.model, agent.cfg
    assert model is not None and cfg is not None, "an agent has artifacts once it has a config"
    state = {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}
    own, counts, own_metric = _own_prototypes(agent)
    targets = {int(c): np.array(v, copy=True) for c, v in agent.objective.table().items()}
    # The global model a rule keeps up to date (the ridge predictor's route: g), else the backbone as shipped.
    refreshed = first_answer(agent.rules, lambda r: r.global_model())
    global_backbone = agent.backbone if refreshed is None else np.array(refreshed, np.float32, copy=True)
    return DeviceArtifacts(
        client_id=agent.client_id,
        fed=agent.fed,
        cfg=cfg,
        arch=model.arch,
        rounds_trained=agent.stats.rounds_trained,
        state=state,
        spec=model_spec(model, agent.data.mean, agent.data.std),
        own=own,
        counts=counts,
        own_metric=own_metric,
        targets=targets,
        metric=agent.objective.metric,
        final=agent.finished,
        predictor=agent.global_head,
        backbone=global_backbone if agent.global_head is not None else None,
        backbone_norm=agent.backbone_norm if agent.global_head is not None else None,
    )


def write_device_artifacts(
    agent: EdgeAgent, root: str | os.PathLike[str], class_names: Sequence[str] | None = None, data: str | None = None
) -> Path:
    """Write ROOT/devices/<id>/ for `agent` (configured: it holds a model); returns that folder. `data`: the
    spec of its data (`--data`), recorded so that the export tools can default to the same inputs."""
    return collect_device_artifacts(agent).write(root, class_names, data)
