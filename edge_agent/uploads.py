"""A device's training-phase uploads, fitted to its upload budget (protofl.budget). numpy only.

The plan says what travels (the adapter or the full model, prototypes) and in which dtype; with a
budget, `train_uploads` lowers the precision and then a sparse vector's K (where a technique makes the
vector sparse) until the encoded messages fit.
Sizes are those of the real encoded messages (`message_size`), envelope included.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from edge_agent.techniques import Sparsifier
from protofl.budget import UploadChoice, choose_upload, leaner
from protofl.plan import Phase, RoundPlan
from protofl.sparse import SparseVector
from protofl.wire import Message, ParamsUpload, ProtoSet, ProtoUpload, message_size


def train_uploads(
    plan: RoundPlan,
    *,
    theta: np.ndarray | SparseVector | None,
    sparsifier: Sparsifier | None,
    global_adapter: np.ndarray | None,
    base_round: int,
    local: ProtoSet | None,
    n: int,
    round_: int,
    fed: str,
    sender: str,
    budget: int | None,
    public: ProtoSet | None = None,
    vector_dt: str | None = None,
) -> tuple[list[Message], UploadChoice | None]:
    """(the uploads, the choice made; None without a budget: the config's encoding).

    `public`: public-set prototypes that travel with the training upload; `vector_dt`: the dtype the vector
    travels in whatever the budget (a rule's `vector_dtype`)."""
    k0 = sparsifier.k if sparsifier is not None and theta is not None else None

    def build(dt: str, k: int | None) -> list[Message]:
        # `dt` caps the precision: an array the config already sends leaner stays as it is.
        out: list[Message] = []
        if theta is not None:
            update: np.ndarray | SparseVector = theta
            if sparsifier is not None and k is not None and isinstance(theta, np.ndarray):
                update = sparsifier.select(theta, global_adapter, k)
            vdt = vector_dt or leaner(dt, plan.adapter_dtype)
            out.append(ParamsUpload(update=update, n_samples=n, base_round=base_round, dt=vdt))
        if local is not None:
            pub = None if public is None else dataclasses.replace(public, dt=leaner(dt, plan.proto_dtype))
            out.append(
                ProtoUpload(local=dataclasses.replace(local, dt=leaner(dt, plan.proto_dtype)), public=pub, n_samples=n)
            )
        return out

    def size_of(dt: str, k: int | None) -> int | None:
        try:
            return sum(
                message_size(m, fed=fed, sender=sender, round=round_, phase=Phase.TRAIN.value) for m in build(dt, k)
            )
        except ValueError:  # e.g. f2 cannot carry values beyond +-65504
            return None

    if budget is None:
        return build("f4", k0), None  # "f4" caps nothing: each array in the config's dtype
    choice = choose_upload(size_of, "f4", k0, budget)
    return build(choice.dt, choice.k), choice
