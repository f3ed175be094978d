"""TinyProto's device half: prototypes travel as their s values on the class's mask (CPS), mean ones as
n_kc * p_kc (scaling, counts hidden); targets come back scattered onto the masks and, scaled, as
mu * G_c or (mu = "auto") G_c at this device's own prototype norm.

Spherical CPS (the `protofl` preset): unit prototypes are cut to their mask and renormalised before they
travel. The math and the server half are protofl/algorithms/cps.py, scaling.py and support.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from edge_agent.techniques import DeviceRule
from protofl.algorithms import scaling, support
from protofl.config import FederationConfig
from protofl.errors import WireError
from protofl.plan import RoundPlan
from protofl.wire import Config


class CpsDevice(DeviceRule):
    name = "cps"

    def __init__(self, cfg: FederationConfig, plan: RoundPlan, config: Config) -> None:
        super().__init__(cfg, plan, config)
        self.masks: np.ndarray | None = config.class_masks if plan.masked else None
        # This device's prototype norms per class, on the masks: what mu = "auto" rescales targets to.
        self.local_norms: dict[int, float] = {}

    def decode_targets(self, table: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        plan = self.plan
        if plan.masked:
            if self.masks is None:
                raise WireError("targets are CPS-compressed but this federation's config has no masks")
            table = support.reconstruct_table(table, self.masks)
        if self.cfg.scaling and plan.prototypes == "mean":
            # Public-covered classes (the public-set mean) are never scaled.
            public = set(plan.public_classes)
            scaled = {c: v for c, v in table.items() if c not in public}
            if self.cfg.mu == "auto":
                # Without any local prototype we hold none of these classes, so no sample of ours
                # would use their targets: drop them rather than guess a magnitude.
                scaled = scaling.auto_rescale(scaled, self.local_norms) if self.local_norms else {}
                table = {c: v for c, v in table.items() if c in public}
            else:
                scaled = scaling.apply_mu(scaled, float(self.cfg.mu))
            table.update(scaled)
        return table

    def encode_table(
        self, protos: dict[int, np.ndarray], counts: dict[int, int] | None, role: str
    ) -> tuple[dict[int, np.ndarray], dict[int, int] | None]:
        masks = self.masks
        if self.plan.prototypes == "unit":
            if masks is not None and protos:
                kept = sorted(protos)
                cut = support.restrict_to_masks(np.stack([protos[c] for c in kept]), masks[kept])
                protos = {c: cut[i] for i, c in enumerate(kept)}
        elif role == "local":
            self.local_norms.update(scaling.support_norms(protos, masks))
            if self.cfg.scaling and counts is not None:
                protos, counts = scaling.scale_prototypes(protos, counts), None
        if masks is not None:
            protos = support.compress_table(protos, masks)
        return protos, counts

    def state(self) -> dict[str, Any]:
        return {"local_norms": [[int(c), float(v)] for c, v in sorted(self.local_norms.items())]}

    def load_state(self, state: dict[str, Any]) -> None:
        self.local_norms = {int(c): float(v) for c, v in state.get("local_norms", [])}
