"""A device's training-phase uploads as plain values, fitted to its upload budget (protofl.budget).

What training leaves (`plain_values`): the plan says what travels (the adapter or the full model, prototypes), the
active techniques' device rules what each is (the parameter vector and how it is made sparse, the prototype table,
the public set's). `train_uploads` then puts them in messages in the plan's dtypes; with a budget, it lowers the
precision and then a sparse vector's K (where a technique makes the vector sparse) until the encoded messages fit.
Sizes are those of the real encoded messages (`message_size`), envelope included. What comes out is still plain:
the federation's sealing stages (edge_agent/core/sealing.py: DP's noise, masking) come after, then the wire.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from edge_agent.techniques import DeviceContext, DeviceRule, Packer, Sparsifier
from protofl.budget import UploadChoice, choose_upload, leaner
from protofl.errors import ConfigError
from protofl.plan import Phase, RoundPlan, Upload
from protofl.sparse import SparseVector
from protofl.technique import first_answer
from protofl.wire import Message, ParamsUpload, ProtoSet, ProtoUpload, message_size


@dataclass(frozen=True)
class PlainValues:
    """What a round's training leaves to upload, before any budget, sealing or wire: the parameter vector (and how
    it is made sparse, the dtype it must travel in), this device's prototype table, the public set's."""

    theta: np.ndarray | SparseVector | None = None
    sparsifier: Sparsifier | None = None
    vector_dt: str | None = None  # a rule's `vector_dtype`: the vector travels in it whatever the budget
    local: ProtoSet | None = None
    public: ProtoSet | None = None  # public-set prototypes that travel with the training upload


def plain_values(
    rules: Sequence[DeviceRule],
    ctx: DeviceContext,
    pack: Packer,
    features: Callable[[], tuple[np.ndarray, np.ndarray]],
) -> PlainValues:
    """The training phase's values as the active rules make them, in rule order (the first rule's answer where one
    rule speaks). `features`: the features and labels the prototypes average (asked only where the plan sends
    prototypes)."""
    plan = ctx.plan
    sends = plan.sends(Phase.TRAIN)
    theta: np.ndarray | SparseVector | None = None
    for rule in rules if Upload.ADAPTER in sends else ():  # the first rule's vector
        theta = rule.vector(ctx)
        if theta is not None:
            break
    sparsifier = first_answer(rules, lambda r: r.sparsifier(theta)) if isinstance(theta, np.ndarray) else None
    local = None
    if Upload.PROTOS in sends:
        z, y = features()
        found = first_answer(rules, lambda r: r.local_prototypes(z, y))
        if found is None:  # the plan sends prototypes only where an active technique makes them
            raise ConfigError("this federation's plan sends prototypes, but no technique here makes them")
        protos, counts = found
        for rule in rules:
            protos = rule.select_local(protos)
        local = pack(protos, None if counts is None else {c: counts[c] for c in protos}, "local")
    public = first_answer(rules, lambda r: r.public_prototypes(ctx, pack)) if plan.public_phase is Phase.TRAIN else None
    vector_dt = first_answer(rules, lambda r: r.vector_dtype()) if theta is not None else None
    return PlainValues(theta, sparsifier, vector_dt, local, public)


def train_uploads(
    plan: RoundPlan,
    values: PlainValues,
    *,
    global_adapter: np.ndarray | None,
    base_round: int,
    n: int,
    round_: int,
    fed: str,
    sender: str,
    budget: int | None,
) -> tuple[list[Message], UploadChoice | None]:
    """(the uploads, the choice made; None without a budget: the config's encoding)."""
    theta, sparsifier, local, public = values.theta, values.sparsifier, values.local, values.public
    k0 = sparsifier.k if sparsifier is not None and theta is not None else None

    def build(dt: str, k: int | None) -> list[Message]:
        # `dt` caps the precision: an array the config already sends leaner stays as it is.
        out: list[Message] = []
        if theta is not None:
            update: np.ndarray | SparseVector = theta
            if sparsifier is not None and k is not None and isinstance(theta, np.ndarray):
                update = sparsifier.select(theta, global_adapter, k)
            vdt = values.vector_dt or leaner(dt, plan.adapter_dtype)
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
