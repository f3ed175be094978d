"""The device half of median_proto: prototypes go up without their counts."""

from __future__ import annotations

import numpy as np

from edge_agent.techniques import DeviceRule

from . import NAME


class MedianProtoDevice(DeviceRule):
    name = NAME

    def encode_table(
        self, protos: dict[int, np.ndarray], counts: dict[int, int] | None, role: str
    ) -> tuple[dict[int, np.ndarray], dict[int, int] | None]:
        return protos, None
