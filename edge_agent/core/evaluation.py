"""A device's round metrics: how the model it trained classifies its own held-out split (and, in simulation, the
official test set), as the round's objective classifies (edge_agent/techniques: the head's softmax, or another
technique's classifier), beside the nearest-prototype accuracies the benchmark reports. numpy over features: the
agent hands in how to compute them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from edge_agent.techniques import Objective
from protofl.algorithms.prototypes import local_prototypes, nearest_prototype
from protofl.algorithms.support import off_mask_energy
from protofl.wire import Metrics

if TYPE_CHECKING:
    from edge_agent.core.agent import ClientData
    from edge_agent.training.models import ProtoNet
    from edge_agent.training.trainer import TrainStats

__all__ = ["own_prototype_correct", "round_metrics"]


def round_metrics(
    objective: Objective,
    model: ProtoNet,
    embed: Callable[[Any], np.ndarray],
    data: ClientData,
    stats: TrainStats,
    *,
    num_classes: int,
    masks: np.ndarray | None,
    with_test: bool,
    z_train: Callable[[], np.ndarray],
    extra: dict[str, float],
) -> Metrics:
    """The round objective's predictions and the nearest-target-prototype accuracy on the local split and, in
    simulation and `with_test`, on the official test set (with the test set's class probabilities). One forward
    pass per split: both predictions come from the same z. `z_train`: the training split's features now (the
    uploads may have computed them already); `extra`: what `Metrics.extra` carries besides (the clock's timings,
    the upload choice)."""
    z_local = embed(data.x_test)
    local = objective.probabilities(model, z_local)
    correct_local = int((local.argmax(1) == data.y_test).sum()) if len(local) else 0
    proto_local = objective.nearest_correct(z_local, data.y_test, local)
    own_extra = {}
    if masks is not None and len(z_local):
        own_extra["off_mask_energy"] = off_mask_energy(z_local, data.y_test, masks)
    own = own_prototype_correct(z_local, z_train, data, num_classes)
    if own is not None:
        own_extra["own_proto_correct"] = float(own)
    probs, n_test, correct_test, proto_test = None, 0, 0, None
    if with_test and data.x_global is not None and data.y_global is not None:
        z_global = embed(data.x_global)
        probs = objective.probabilities(model, z_global)
        n_test = len(data.y_global)
        correct_test = int((probs.argmax(1) == data.y_global).sum())
        proto_test = objective.nearest_correct(z_global, data.y_global, probs)
    return Metrics(
        n_local=len(data.y_test),
        correct_local=correct_local,
        n_test=n_test,
        correct_test=correct_test,
        probs=probs,
        train_s=stats.seconds,
        loss=stats.loss,
        extra={**extra, **own_extra},
        proto_correct_local=proto_local,
        proto_correct_test=proto_test,
    )


def own_prototype_correct(
    z_local: np.ndarray, z_train: Callable[[], np.ndarray], data: ClientData, num_classes: int
) -> int | None:
    """Correct predictions on the local split by the nearest (L2) of this client's *own* prototypes, the
    class means of its training features now (TinyProto's eq. 12; docs/algorithms.md, Evaluation). The
    benchmark names it apart from the nearest *global* prototype (`proto_correct_local`). None where the
    client has no training data or its features are not finite (a diverged model scores nothing)."""
    if not len(z_local) or not len(data.y_train):
        return None
    z = z_train()
    if not np.isfinite(z).all():
        return None
    own, _ = local_prototypes(z, data.y_train, num_classes)
    return int((nearest_prototype(z_local, own) == data.y_test).sum())
