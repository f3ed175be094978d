"""The federation's deployable artifacts, from the server's model (numpy only; layout in protofl/artifacts.py).

`write_server_artifacts` writes ROOT/manifest.json and ROOT/global/: the prototypes a round message would
carry now, expanded to full width where they travel on support masks, the masks themselves, the class
names, and the federated parameter vector (the global model, or adapter and head) where the preset
federates one; the manifest says whether that is a global predictor (protofl.artifacts.predictor_kind).
`start` calls it (after every round and once more at the end); `simulate --out DIR` at the end. Every file
is replaced atomically, so a reader never sees half of one.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from broker_server.core.stages import ServerModel
from protofl import artifacts as art
from protofl.algorithms import support
from protofl.plan import Phase
from protofl.wire import PublicSet

__all__ = ["global_prototypes", "write_server_artifacts"]


def global_prototypes(model: ServerModel) -> tuple[dict[int, np.ndarray], str] | None:
    """(the federation's prototypes at full width, the metric to compare features with), or None where the
    federation has none (yet).

    They are the targets the next training round message carries: whichever technique builds them. Unit
    prototypes compare by cosine; so do scaled sums (their length counts samples, only their direction is
    the federation's); mean prototypes by L2.
    """
    plan = model.plan
    targets = model.rules.round_targets(Phase.TRAIN)
    if targets is None or len(targets.classes) == 0:
        return None
    table, _ = targets.table()
    masks = model.rules.support_masks()
    if plan.masked and masks is not None:
        table = support.reconstruct_table(table, masks)
    scaled = "scaled" in plan.target_label.split("+")
    metric = "cosine" if plan.prototypes == "unit" or scaled else "l2"
    return {int(c): np.asarray(v, np.float32) for c, v in table.items()}, metric


def write_server_artifacts(
    model: ServerModel,
    root: str | os.PathLike[str],
    *,
    fed: str,
    round_: int,
    finished: bool,
    class_names: Sequence[str] | None = None,
    written_by: str = "protofl-server start",
    data: str | None = None,
    norm: tuple[Sequence[float], Sequence[float]] | None = None,
    backbone: PublicSet | None = None,
) -> Path:
    """Write ROOT/manifest.json and ROOT/global/ for the server's current model; returns ROOT.

    `data` and `norm` (the data spec and its per-channel mean/std, where the server knows them: a
    simulation, or `start --public-data`) let the export tools default to the same inputs. `backbone`: the
    public message that shipped the shared backbone (and its inputs' normalisation), where a global head sits on it
    (global/predictor.npz)."""
    cfg = model.cfg
    out = Path(root)
    names = list(cfg.class_names or class_names or [str(i) for i in range(cfg.num_classes)])
    kind, reason = art.predictor_kind(cfg)
    glob = out / art.GLOBAL
    protos, masks = global_prototypes(model), model.rules.support_masks()
    if protos is not None:
        art.write_prototypes(
            glob / art.PROTOTYPES, protos[0], metric=protos[1], class_names=names, source="global", masks=masks
        )
    final = model.rules.round_fields(Phase.DONE)  # the federated vector, as the final round message carries it
    federated, vector = (
        ("model", final.params)
        if final.params is not None
        else ("adapter", final.adapter)
        if final.adapter is not None
        else (None, None)
    )
    if vector is not None:
        art.write_vector(glob / art.FEDERATED, vector, federated or "")
    head = model.rules.predictor_head()
    head_info = model.rules.predictor_info()
    vec = None if backbone is None else backbone.backbone
    refreshed = model.rules.predictor_backbone()  # the ridge predictor's route: g, the backbone the devices refreshed
    if head is not None:
        what = "refreshed by the devices" if refreshed is not None else "shipped" if vec is not None else None
        head_info = {**head_info, "backbone": what or "seeded initial model"}
        vec = refreshed if refreshed is not None else vec
        if backbone is not None and backbone.norm is not None:
            head_info.update(norm_mean=backbone.norm[0], norm_std=backbone.norm[1])
        art.write_predictor(glob / art.PREDICTOR, head[0], head[1], vec, head_info)
    art.write_json(
        out / art.MANIFEST,
        art.stamp(
            written_by=written_by,
            fed=fed,
            preset=cfg.preset,
            round=int(round_),
            finished=bool(finished),
            config=cfg.to_dict(),
            class_names=names,
            data=data,
            **({"norm_mean": [float(v) for v in norm[0]], "norm_std": [float(v) for v in norm[1]]} if norm else {}),
            predictor={
                "kind": kind if vector is not None or head is not None else None,
                "reason": reason,
                **({"made_from": head_info} if head is not None else {}),
            },
            federated=federated if vector is not None else None,
            prototypes=None
            if protos is None
            else {
                "metric": protos[1],
                "classes": sorted(protos[0]),
                "width": cfg.proto_dim,
                "masked": masks is not None,
            },
        ),
    )
    return out
