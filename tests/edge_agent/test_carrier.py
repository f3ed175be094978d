"""`Carrier.carry`, the one path an agent's outcome is carried out by (edge_agent/core/outcome.py): the MQTT runner and
the
simulator's `LocalDevice` override its steps, never its order. No broker, no agent: outcomes made by hand."""

from __future__ import annotations

from typing import Any

import pytest

from edge_agent.core.outcome import Carrier, Failure, Outcome, Send


class Recording(Carrier):
    def __init__(self) -> None:
        self.did: list[Any] = []

    def checkpoint(self) -> None:
        self.did.append("checkpoint")

    def configured(self) -> None:
        self.did.append("configured")

    def publish(self, send: Send) -> None:
        self.did.append(send.kind)

    def deploy(self, artifacts: Any) -> None:
        self.did.append("deploy")

    def failed(self, failure: Failure) -> None:
        self.did.append(("failed", failure.round))

    def carried(self, out: Outcome) -> None:
        self.did.append("carried")


def _send(kind: str) -> Send:
    return Send("protofl/f/up/d", kind.encode(), kind, 1, "train")


def test_a_round_outcome_is_kept_on_disk_before_its_sends_then_artifacts_then_the_failure() -> None:
    # Every step an outcome can ask for at once (no real round asks for all): the order is the contract - the
    # checkpoint first (an upload never leaves before the state that made it), the sends in their order.
    out = Outcome(
        sends=(_send("protos"), _send("metrics")),
        changed=True,
        failure=Failure(1, "train", "diverged"),
        artifacts=object(),  # type: ignore[arg-type]
    )
    carrier = Recording()
    carrier.carry(out)
    assert carrier.did == ["checkpoint", "protos", "metrics", "deploy", ("failed", 1), "carried"]


def test_a_config_outcome_and_an_empty_one_are_carried_too() -> None:
    carrier = Recording()
    carrier.carry(Outcome(configured=True))  # a config adopted: a checkpoint may be loaded into the new model
    carrier.carry(Outcome())  # e.g. the public set: nothing to do, still through the same path
    assert carrier.did == ["configured", "carried", "carried"]


def test_the_default_steps_do_nothing_but_publishing_is_every_carriers_own() -> None:
    Carrier().carry(Outcome(changed=True, configured=True, failure=Failure(2, "protos", "bad anchors")))
    with pytest.raises(NotImplementedError):
        Carrier().carry(Outcome(sends=(_send("join"),)))
