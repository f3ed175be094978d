"""ERPA's device half (RefProtoFL Alg. 3): prototypes of the server's public set for the classes it
covers, local ones for the rest.

With mean prototypes they are a round's first phase (the server turns them into anchors, which come
back as alignment targets); on unit prototypes (candidate (d)) the public set's unit prototypes travel
with the training upload and the local ones leave out the covered classes. The math and the server half
are protofl/algorithms/erpa.py.
"""

from __future__ import annotations

import numpy as np

from edge_agent.techniques import DeviceContext, DeviceRule, Packer
from protofl.algorithms import erpa, unit
from protofl.plan import Phase
from protofl.wire import ProtoSet, ProtoUpload


class ErpaDevice(DeviceRule):
    name = "erpa"

    def _public_z(self, ctx: DeviceContext) -> np.ndarray | None:
        if not self.plan.public_classes or ctx.public_x is None or ctx.public_y is None:
            return None
        return ctx.embed(ctx.public_x)

    def phase_upload(self, ctx: DeviceContext, phase: Phase, pack: Packer) -> ProtoUpload | None:
        if phase is not Phase.PROTO:
            return None
        plan = self.plan
        z_public = self._public_z(ctx)
        pub, local, counts = erpa.client_prototypes(
            z_public, ctx.public_y, ctx.embed(ctx.x), ctx.y, plan.num_classes, plan.public_classes
        )
        public = pack(pub, None, "public") if z_public is not None else None
        return ProtoUpload(local=pack(local, counts, "local"), public=public, n_samples=len(ctx.y))

    def select_local(self, protos: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        if self.plan.public_phase is not Phase.TRAIN:
            return protos
        covered = set(self.plan.public_classes)
        return {c: v for c, v in protos.items() if c not in covered}

    def public_prototypes(self, ctx: DeviceContext, pack: Packer) -> ProtoSet | None:
        if self.plan.public_phase is not Phase.TRAIN:
            return None
        z_public = self._public_z(ctx)
        if z_public is None or ctx.public_y is None:  # _public_z is None without public labels too
            return None
        covered = set(self.plan.public_classes)
        protos = unit.client_prototypes(z_public, ctx.public_y, self.plan.num_classes)
        return pack({c: v for c, v in protos.items() if c in covered}, None, "public")
