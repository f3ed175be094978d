"""The core fields of a federation config and their defaults, in the order they travel (protofl/config.py).

Apart from config.py so that the technique registry (protofl/registry.py), which config.py reads, knows them
too: an installed technique may not declare an option, or take a name, that a core field has.
"""

from __future__ import annotations

from typing import Any

from protofl import participation

# min_local_steps' default, chosen by measurement (bench/results/SMALL.md).
MIN_LOCAL_STEPS = 20

# The core fields and their defaults, in the order they travel.
CORE: dict[str, Any] = dict(
    preset="protofl",
    seed=0,
    rounds=10,
    # The client model: backbone(s) round-robin over clients, prototype space z in R^m.
    archs=("cnn",),
    num_classes=10,
    in_shape=(1, 28, 28),
    proto_dim=512,
    adapter_rank=32,
    # Local training (docs/algorithms.md: the papers' shared defaults).
    local_epochs=1,
    # A step floor: a round trains at least this many SGD steps, whole epochs then part of one more (a device with
    # 190 images at batch 64 takes 3 steps an epoch and learned nothing in 8 rounds: issue 56, docs/algorithms.md).
    min_local_steps=MIN_LOCAL_STEPS,
    batch_size=64,
    lr=0.01,
    momentum=0.9,
    weight_decay=1e-4,
    backbone="train",  # "train" | "frozen" (one paper contradicts itself; both supported)
    # How PFLlib's FedProto differs from ours (bench/fedproto_gap.py measures each; docs/algorithms.md):
    drop_last=False,  # skip each epoch's last incomplete batch (PFLlib's DataLoader drop_last=True)
    keep_optimizer=False,  # momentum buffers carried across rounds (PFLlib: one optimiser per client)
    proto_source="after",  # local prototypes: "after" training, re-embedded in eval mode | "during" (PFLlib)
    # What crosses the network.
    federate="adapter",  # "full" (the whole model), "adapter" (the federated adapter), "none"
    prototypes="mean",  # "none", "mean" (class means), "unit" (unit prototypes on the sphere)
    aggregation="weighted",  # global mean prototype: "weighted" by n_kc (paper) or "mean" (PFLlib)
    proto_lambda=1.0,  # weight of the prototype alignment term
    # Wire.
    proto_dtype="f4",
    adapter_dtype="f4",
    # Rounds and faults.
    min_clients=1,
    round_timeout=600.0,
    # The server's public set, carved out of the training data for every preset (so that every method's clients
    # hold the same data); the plan says whether a technique uses it (ERPA's anchors).
    public_per_class=20,
    public_classes=None,  # the classes it covers: None = every class
    # The federation's class names, one per class id (None: unnamed): every device maps its class folders' (and a
    # CSV's label strings') names onto these ids (protofl/data/own.py), and the artifacts name classes by them.
    class_names=None,
    # Who takes part each round, and buffered asynchronous rounds (protofl/participation.py, issue 47).
    **participation.FIELDS,
    # Differential privacy of the uploads (protofl/privacy.py, docs/privacy.md): the run's budget (None: off), its
    # delta, each row's L2 clip on the device, the noise multiplier (None: calibrated from the budget over `rounds`).
    dp_epsilon=None,
    dp_delta=1e-5,
    dp_clip=1.0,
    dp_noise=None,
    dp_mode="local",
    # Secure aggregation of the prototype sums (protofl/secagg.py, docs/privacy.md): on/off, and the bound of every
    # value a device masks (it clips to +-secagg_bound; the fixed-point ring is chosen from it and the devices).
    secagg=False,
    secagg_bound=1e4,
    # Its threat model (protofl/secagg_params.py): the fraction of devices expected to drop before answering and the
    # fraction that may collude with the server. Either set: each round's neighbours k and threshold t are derived
    # from them; neither (None): the fixed k = 2 ceil(log2 n), t = k/2 + 1.
    secagg_dropout=None,
    secagg_corrupt=None,
)
