"""What `protofl-edge models` shows a user choosing a model for a device: its parameters, the bytes a round
uploads under each preset, and the peak resident memory of a `join` training it, as measured.

Upload bytes are computed by the device's own code: an `EdgeAgent` adopts the preset's config (the config
message a server would send: support masks of the plan's width, whose positions change no byte, its adapter layout
and a public set where the plan uses one) and builds a round's uploads as a round builds them
(`EdgeAgent.round_uploads`, no training: values differ from a trained model's, sizes do not), then the wire
encoder sizes them (`message_size`, envelope included). Rounds 1 and 2 are built: an upload that
travels once (the ridge statistics of the `protofl` preset) makes round 1 larger.

Peak memory is not computed: it is read from `footprint.json`, written by `bench/bench_footprint.py
--package-data` (a real server and one real `join` per architecture and preset), with the machine and date
it was measured on. It holds for the shape it was measured at (Fashion-MNIST, 1x28x28, 10 classes, m=512).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edge_agent.core.agent import ClientData, EdgeAgent
from edge_agent.ops.footprint import FOOTPRINT, Footprint, load_footprint
from edge_agent.techniques import model_options
from edge_agent.training import params as model_params
from edge_agent.training.models import build_model
from protofl.plan import RoundPlan
from protofl.presets import make_config
from protofl.wire import Config, PublicSet, message_size

__all__ = ["FOOTPRINT", "MEASURED_SHAPE", "SENDER", "Footprint", "RoundBytes", "load_footprint", "round_bytes"]

MEASURED_SHAPE = ((1, 28, 28), 10, 512)  # (in_shape, classes, m) of the footprint benchmark's runs
SENDER = "device-0001"  # each upload's envelope names its sender: a longer id adds its extra bytes


@dataclass(frozen=True)
class RoundBytes:
    """Bytes one device uploads in a round, every phase, envelopes included."""

    first: int  # round 1
    later: int  # round 2 (and every later one): less where something travels once


def round_bytes(arch: str, preset: str, in_shape: tuple[int, int, int], classes: int, proto_dim: int) -> RoundBytes:
    """The encoded uploads of rounds 1 and 2 of a device training `arch` under `preset`."""
    cfg = make_config(preset, archs=[arch], in_shape=list(in_shape), num_classes=classes, proto_dim=proto_dim)
    plan = RoundPlan.from_config(cfg)
    n = 2 * classes  # two samples of each class: every class has a prototype, as on a device holding them all
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, *in_shape)).astype(np.float32)
    y = np.arange(n, dtype=np.int64) % classes
    agent = EdgeAgent(SENDER, "sizes", ClientData(x, y, x[:classes], y[:classes]), arch=arch)
    layout = []  # the device checks the announced layout against its model's in an adapter federation only
    if plan.federate == "adapter":
        model = build_model(arch, in_shape, classes, proto_dim, cfg.adapter_rank, seed=cfg.seed, **model_options(cfg))
        layout = model_params.adapter_layout(model)
    masks = sizing_masks(classes, proto_dim, plan.proto_width) if plan.masked else None
    agent.on_config(
        Config(
            preset=preset,
            params=cfg.to_dict(),
            adapter_layout=layout,
            class_masks=masks,
        )
    )
    if plan.public_classes:
        pub = np.repeat(np.asarray(plan.public_classes, dtype=np.int64), 2)
        images = np.zeros((len(pub), *in_shape), np.uint8)
        agent.on_public(PublicSet(x=images, y=pub, classes=list(plan.public_classes)))
    sizes = []
    for round_ in (1, 2):
        ups = agent.round_uploads(round_)
        sizes.append(sum(message_size(m, fed="sizes", sender=SENDER, round=round_, phase=p.value) for p, m in ups))
    return RoundBytes(sizes[0], sizes[1])


def sizing_masks(classes: int, dim: int, width: int) -> np.ndarray:
    """(classes, dim) support masks of `width` positions each, distinct per class: what a masked upload's size
    depends on (the server's masks are drawn from the federation's seed; their positions change no byte)."""
    masks = np.zeros((classes, dim), bool)
    for c in range(classes):
        masks[c, (c * width + np.arange(width)) % dim] = True
    return masks
