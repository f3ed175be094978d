"""The round plan: what a federation's config means for its rounds, derived once and read by both sides.

The active techniques shape it (protofl/technique.py, `Technique.shape`): which phases a round has, what
each client uploads in each phase, which round message carries the global adapter, the label of the
targets a round message carries, and how prototypes travel (width, support masks, dtype). The round
machine, the server rules, the device and its rules ask the plan; none of them reads a technique's
switches itself. A combination that has no meaning is refused with a reason by the technique whose rule
it breaks (docs/design.md, "Techniques").
"""

from __future__ import annotations

from dataclasses import dataclass

from protofl.config import FederationConfig
from protofl.technique import Phase, Upload
from protofl.wire import Limits

__all__ = ["MiB", "Phase", "RoundPlan", "Upload"]

MiB = 2**20


@dataclass(frozen=True)
class RoundPlan:
    phases: tuple[Phase, ...]
    uploads: dict[Phase, tuple[Upload, ...]]
    adapter_phase: Phase | None  # the phase whose round message carries the global adapter
    federate: str  # "full" | "adapter" | "none"
    prototypes: str  # "none" | "mean" | "unit"
    target_label: str  # what the round message calls its targets (checked by the device)
    masked: bool  # prototypes travel as their values on the class's support mask
    proto_width: int  # values per class on the wire
    public_classes: tuple[int, ...]  # the classes of the server's public set (none without one)
    public_phase: Phase | None  # the phase whose prototype upload carries public-set prototypes
    num_classes: int
    proto_dim: int
    proto_dtype: str
    adapter_dtype: str
    techniques: tuple[str, ...]  # the active techniques, in rule order
    shared_backbone: bool = False  # the public message ships a shared backbone (edge_agent/training/backbone.py)

    @classmethod
    def from_config(cls, cfg: FederationConfig) -> RoundPlan:
        d = cfg.draft
        return cls(
            phases=d.phases,
            uploads={p: d.uploads.get(p, ()) for p in d.phases},
            adapter_phase=None if cfg.federate != "adapter" else d.phases[0],
            federate=d.federate,
            prototypes=d.prototypes,
            target_label="+".join(d.target_label),
            masked=d.masked,
            proto_width=d.proto_width,
            public_classes=d.public_classes,
            public_phase=d.public_phase,
            num_classes=d.num_classes,
            proto_dim=d.proto_dim,
            proto_dtype=d.proto_dtype,
            adapter_dtype=d.adapter_dtype,
            techniques=cfg.techniques,
            shared_backbone=d.shared_backbone,
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
        return Limits(max_message_bytes=message, max_elements=elements, max_bin_len=max(default.max_bin_len, message))
