"""The round plan: what a federation's stage switches mean, derived once from the config.

Both sides read the same plan, so they cannot disagree about a phase: which phases a round has,
what each client uploads in each phase, which round message carries the global adapter, what the
training targets are and how prototypes travel (width, CPS, scaling, dtype). The aggregator, the
server stages, the device and its trainer ask the plan; none of them reads the switches itself.

A switch combination that has no meaning is rejected by the config (protofl.config) with a reason.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from protofl.config import FederationConfig
from protofl.wire import Limits

MiB = 2**20


class Phase(str, enum.Enum):
    """A round's phases, as they travel in the envelope's `phase` field."""

    PROTO = "proto"  # ERPA phase 1: prototypes on the public set -> anchors
    TRAIN = "train"  # local training -> adapter and/or prototype uploads
    DONE = "done"  # the federation is over (final round message)


class Upload(str, enum.Enum):
    """What a client sends in a phase, as the envelope's `kind`."""

    PROTOS = "protos"
    ADAPTER = "adapter"


class TargetKind(str, enum.Enum):
    """What the prototype term of the local loss aligns z to."""

    NONE = "none"  # cross-entropy only (FedAvg, or no target for this round yet)
    MSE = "mse"  # FedProto / TinyProto: global prototypes
    ANCHOR = "anchor"  # ERPA anchors
    PAGR = "pagr"  # FedPAGR: refined unit prototypes, anchored head


@dataclass(frozen=True)
class RoundPlan:
    phases: tuple[Phase, ...]
    uploads: dict[Phase, tuple[Upload, ...]]
    adapter_phase: Phase | None  # the phase whose round message carries the global adapter
    federate: str  # "full" | "adapter" | "none"
    apud: bool
    prototypes: str  # "none" | "mean" | "unit"
    target: TargetKind
    public_in_train: bool  # ERPA on unit prototypes: public-set prototypes travel with the training upload
    cps: bool  # prototypes travel as their s values on the class's mask
    scaled: bool  # local prototypes travel as n_kc * p_kc, counts hidden (TinyProto scaling)
    proto_width: int  # values per class on the wire
    anchor_kind: str  # the round message's label for its anchors
    public_classes: tuple[int, ...]
    num_classes: int
    proto_dim: int
    proto_dtype: str
    adapter_dtype: str

    @classmethod
    def from_config(cls, cfg: FederationConfig) -> "RoundPlan":
        # ERPA on unit prototypes (candidate (d)) has one phase: with nothing federated, a device's
        # features do not change between the end of its training in round t and the start of round t+1,
        # so the public-set prototypes it would send in round t+1's phase 1 are the ones it can send with
        # round t's training upload (one round trip fewer; the first round trains on FedPAGR's seeded
        # random prototypes instead of anchors).
        public_in_train = cfg.erpa and cfg.prototypes == "unit"
        erpa = cfg.erpa and not public_in_train
        phases = (Phase.PROTO, Phase.TRAIN) if erpa else (Phase.TRAIN,)
        train: list[Upload] = []
        if cfg.federate != "none":
            train.append(Upload.ADAPTER)
        if cfg.prototypes != "none" and not erpa:
            train.append(Upload.PROTOS)  # with ERPA the prototypes went up in the proto phase
        uploads = {Phase.TRAIN: tuple(train)}
        if erpa:
            uploads[Phase.PROTO] = (Upload.PROTOS,)
        if cfg.prototypes == "unit":  # FedPAGR; with cps: spherical CPS, unit prototypes on their masks
            target, anchor_kind = TargetKind.PAGR, "unit+cps" if cfg.cps else "unit"
        else:
            target = TargetKind.ANCHOR if erpa else (TargetKind.MSE if cfg.prototypes == "mean" else TargetKind.NONE)
            anchor_kind = "+".join(["cps" if cfg.cps else "dense"] + (["scaled"] if cfg.scaling else []))
        unit = cfg.prototypes == "unit"
        return cls(
            phases=phases,
            uploads=uploads,
            adapter_phase=None if cfg.federate != "adapter" else phases[0],
            federate=cfg.federate,
            apud=cfg.apud,
            prototypes=cfg.prototypes,
            target=target,
            public_in_train=public_in_train,
            cps=cfg.cps,
            scaled=cfg.scaling and not unit,
            proto_width=cfg.s if cfg.cps else cfg.proto_dim,
            anchor_kind=anchor_kind,
            public_classes=cfg.public_class_list,
            num_classes=cfg.num_classes,
            proto_dim=cfg.proto_dim,
            proto_dtype=cfg.proto_dtype,
            adapter_dtype=cfg.adapter_dtype,
        )

    @property
    def two_phase(self) -> bool:
        return len(self.phases) == 2

    @property
    def first_phase(self) -> Phase:
        return self.phases[0]

    def sends(self, phase: Phase) -> tuple[Upload, ...]:
        """What every client uploads in `phase` (a phase closes when a client has sent all of it)."""
        return self.uploads.get(phase, ())

    def next_phase(self, phase: Phase) -> Phase | None:
        i = self.phases.index(phase)
        return self.phases[i + 1] if i + 1 < len(self.phases) else None

    @property
    def counts_with_prototypes(self) -> bool:
        """Whether local prototypes travel with their n_kc (not with scaling, which hides them)."""
        return not self.scaled and self.prototypes == "mean"

    def limits(self, model_values: int | None, adapter_values: int = 0) -> Limits:
        """Decoder limits for this federation: its largest message, with headroom.

        `model_values` is the length of the full parameter vector (FedAvg) when known; `adapter_values`
        the adapter's. The bound counts the biggest array a message of this plan carries at 4 bytes a
        value (f4, the widest wire dtype), a dense/index sparse form of the adapter, the prototype
        tables and the class masks, plus 25 % and 1 MiB for envelopes, keys and metrics. It never
        drops below the codec's defaults, so small federations keep today's limits.
        """
        default = Limits()
        dense = 0
        if self.federate == "full":
            dense = 4 * (model_values or 0)
        elif self.federate == "adapter":
            dense = 8 * adapter_values  # a sparse upload may carry u4 indices + f4 values
        protos = 2 * 4 * self.num_classes * self.proto_dim  # public + local tables, dense width
        masks = self.num_classes * self.proto_dim // 8
        need = int(1.25 * (dense + protos + masks)) + MiB
        message = max(default.max_message_bytes, need)
        elements = max(default.max_elements, (model_values or 0) + 1, 2 * adapter_values)
        return Limits(max_message_bytes=message, max_elements=elements,
                      max_bin_len=max(default.max_bin_len, message))
