"""Sealing stages: what happens to a device's upload between training and the wire.

An upload leaves training as plain values (edge_agent/core/uploads.py builds them, fitted to the upload budget) and
passes the federation's stages in order, each an `Outgoing` in and an `Outgoing` out: privacy noise (local or
distributed DP, `PrivacyNoise`), then masking (secure aggregation, edge_agent/core/secagg_device.py), then the wire (the
agent encodes what comes out). The stages are built once from the federation's config (`stages`); the agent names
none of them. A stage that runs a protocol of its own with the server (masking) also answers that protocol's
messages to this device (`answer`), as effects: the reply to send, or why it drops the message.

Concerns that wrap an upload live here, not in training: training never sees noise or masks, and a stage sees only
what would otherwise travel. Flower's client mods are the model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from edge_agent.core.outcome import Drop
from protofl import privacy
from protofl.wire import Envelope, Message, ProtoSet, ProtoUpload

__all__ = ["Answer", "Outgoing", "PrivacyNoise", "Stage"]


@dataclass(frozen=True)
class Outgoing:
    """An upload on its way out, with the envelope it will travel in."""

    msg: Message
    fed: str
    sender: str
    round: int
    phase: str


@dataclass(frozen=True)
class Answer:
    """A stage's answer to a server message of its protocol: the message to send (None: nothing, e.g. a step that
    asks nothing of this device), or why it drops the server's message."""

    reply: Message | None = None
    drop: Drop | None = None
    # With a drop: this device leaves the phase, and its presence tells the server why (`gave_up`: the server stops
    # waiting for it in that phase; e.g. a secure-aggregation roster it refuses).
    leave: bool = False


class Stage:
    """One sealing stage of a federation (built when its config arrives; it may keep what its protocol needs
    between an upload and the server's later steps)."""

    def seal(self, up: Outgoing, rng: np.random.Generator) -> Outgoing:
        """`up` sealed (`rng`: the device's own generator, from the OS's entropy: noise a server could not undo)."""
        return up

    def answer(self, env: Envelope, msg: Message) -> Answer | None:
        """This stage's answer to a server message on this device's own topic (None: not one of its messages)."""
        return None


class PrivacyNoise(Stage):
    """Differential privacy of the prototype tables sent (protofl/privacy.py): every row clipped to the DP clip,
    then N(0, std^2) added to every value (`std`: all of the noise for local DP, this device's share under
    secure aggregation for distributed DP); counts travel as 1. Sample counts stay on the device: the uploads
    carry 1 (edge_agent/core/device_config.py, `DeviceConfig.samples_sent`)."""

    def __init__(self, dp: privacy.DpSettings, min_clients: int) -> None:
        self.clip = dp.clip
        self.std = dp.device_std(min_clients)

    def seal(self, up: Outgoing, rng: np.random.Generator) -> Outgoing:
        msg = up.msg
        if not isinstance(msg, ProtoUpload):
            return up  # (DP covers prototype uploads only: a federation that sends others is refused)
        local, public = self._noised(msg.local, rng), self._noised(msg.public, rng)
        return dataclasses.replace(up, msg=ProtoUpload(local=local, public=public, n_samples=msg.n_samples))

    def _noised(self, ps: ProtoSet | None, rng: np.random.Generator) -> ProtoSet | None:
        if ps is None:
            return None
        table, counts = ps.table()
        table, counts = privacy.privatize(table, counts, self.std, self.clip, rng)
        return ProtoSet.from_table(table, ps.values.shape[1], ps.dt, counts)
