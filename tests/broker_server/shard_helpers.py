"""Sharded aggregators against one aggregator: numpy devices that send the same seeded uploads to either,
and the state the two must agree on."""

from __future__ import annotations

from typing import Any

import numpy as np

from protofl import topics
from protofl.adapter import adapter_layout, layout_size
from protofl.config import FederationConfig
from protofl.plan import Phase, RoundPlan, Upload
from protofl.sparse import SparseVector
from protofl.transport.base import Transport
from protofl.wire import (
    Join,
    Metrics,
    ParamsUpload,
    ProtoSet,
    ProtoUpload,
    Resend,
    RoundStart,
    decode_body,
    encode_message,
    read_header,
)
from tests.wire_helpers import ridge_upload

FED = "sh"
FULL_MODEL = 40  # fedavg's model length (the server knows none: the first upload fixes it)


class NumpyDevice:
    """A device that joins, and answers every round message with seeded uploads the plan asks for (the same
    ones when it is asked again)."""

    def __init__(self, name: str, index: int, cfg: FederationConfig, transport: Transport) -> None:
        self.name, self.index, self.cfg, self.t = name, index, cfg, transport
        self.plan = RoundPlan.from_config(cfg)
        self.sent: set[tuple[int, str]] = set()
        self.done = False
        self.twice = False  # send every upload twice (a re-send after a lost acknowledgement)
        self.masks: np.ndarray | None = None
        self.t.subscribe(topics.round_(FED), self.on_round)
        self.t.subscribe(topics.down(FED, name), self.on_down)  # the server's re-send requests, as a real device

    def join(self) -> None:
        self.send(Join(arch="cnn", n_samples=10 + self.index), 0, "")

    def join_when_announced(self) -> None:
        """Join once the server's retained config is here, as a real device does (over MQTT the server's
        subscriptions are in place by then: it announces after subscribing, on the same connection)."""
        joined: list[bool] = []

        def on_config(topic: str, payload: bytes) -> None:
            if payload and not joined:
                joined.append(True)
                self.join()

        self.t.subscribe(topics.config(FED), on_config)

    def send(self, msg: Any, round_: int, phase: str) -> None:
        self.t.publish(
            topics.up(FED, self.name), encode_message(msg, fed=FED, sender=self.name, round=round_, phase=phase)
        )

    def on_round(self, topic: str, payload: bytes) -> None:
        if not payload:
            return
        head = read_header(payload)
        msg = decode_body(head.open())
        assert isinstance(msg, RoundStart)
        if msg.final:
            self.done = True
            return
        # Asked again (a restarted server announces its round again): the uploads again, as a real device does.
        key = (head.round, head.phase)
        again = key in self.sent
        self.sent.add(key)
        self.send_uploads(head.round, head.phase)
        if Phase(head.phase) is self.plan.phases[-1] and self.index % 2 == 0 and not again:  # (varies which shard)
            self.send(Metrics(n_local=10, correct_local=5, n_test=10, correct_test=5), head.round, "")

    def send_uploads(self, round_: int, phase_name: str) -> None:
        """The (seeded, so always the same) uploads of a round's phase."""
        phase = Phase(phase_name)
        rng = np.random.default_rng([self.index, round_, self.plan.phases.index(phase)])
        for kind in self.plan.sends(phase):
            up = self.upload(kind, phase, round_, rng)
            for _ in range(2 if self.twice else 1):
                self.send(up, round_, phase_name)

    def on_down(self, topic: str, payload: bytes) -> None:
        """A re-send request (wire Resend): the join, or the uploads of the round and phase it names."""
        head = read_header(payload)
        msg = decode_body(head.open())
        assert isinstance(msg, Resend), msg
        if msg.ask == "join":
            self.join()
        elif (head.round, head.phase) in self.sent:
            self.send_uploads(head.round, head.phase)

    def upload(self, kind: Upload, phase: Phase, round_: int, rng: np.random.Generator) -> Any:
        plan, cfg = self.plan, self.cfg
        if kind is Upload.ADAPTER:
            if plan.federate == "none":  # the ridge predictor's statistics (the protofl preset)
                return ridge_upload(cfg, round_, 5 + self.index, rng)
            if plan.federate == "full":
                return ParamsUpload(
                    update=rng.normal(size=FULL_MODEL).astype(np.float32), n_samples=5 + self.index, base_round=round_
                )
            n = layout_size(adapter_layout(cfg.proto_dim, cfg.adapter_rank, cfg.num_classes))
            if cfg.options.get("apud"):
                idx = np.sort(rng.choice(n, size=max(1, n // 5), replace=False)).astype(np.int64)
                update: Any = SparseVector(n, idx, rng.normal(size=idx.size).astype(np.float32))
            else:
                update = rng.normal(size=n).astype(np.float32)
            return ParamsUpload(update=update, n_samples=5 + self.index, base_round=round_)
        public = set(plan.public_classes)
        with_public = plan.public_phase is phase and bool(public)
        classes = [c for c in range(plan.num_classes) if rng.random() < 0.8 and not (with_public and c in public)]
        local = self.table(classes, rng)
        pub = self.table(sorted(public), rng) if with_public else None
        return ProtoUpload(local=local, public=pub, n_samples=10 + self.index)

    def table(self, classes: list[int], rng: np.random.Generator) -> ProtoSet | None:
        if not classes:
            return None
        width = self.plan.proto_width
        values = rng.normal(size=(len(classes), width)).astype(np.float32) + 0.1
        if self.index == 0:
            values *= 50.0  # one far device, so that clipping acts (and its counts must merge)
        counts = np.array([3 + (c + self.index) % 4 for c in classes])
        return ProtoSet(classes=np.array(classes), values=values, counts=counts)


def config(preset: str, **overrides: Any) -> FederationConfig:
    from protofl.presets import make_config

    return make_config(
        preset,
        num_classes=4,
        proto_dim=8,
        adapter_rank=2,
        min_clients=4,
        rounds=3,
        public_per_class=1,
        round_timeout=60,
        **overrides,
    )


def model_state(model: Any) -> dict[str, Any]:
    """What the federation agreed on: the values the two must share (float tolerance)."""
    out: dict[str, Any] = {}
    for name, value in model.rules.state_values().items():  # every technique's state: vectors, prototypes...
        out[name] = value.table()[0] if isinstance(value, ProtoSet) else value
    out["masks"] = model.rules.support_masks()
    out["radii"] = dict(model.radii)
    out["clipped"] = dict(model.clipped)
    return out


def assert_close(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for k in a:
            assert_close(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert a is not None and b is not None, f"{where}: {a} vs {b}"
        np.testing.assert_allclose(
            np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-5, atol=1e-6, err_msg=where
        )
    elif isinstance(a, float):
        assert abs(a - b) <= 1e-6 * max(1.0, abs(a)), f"{where}: {a} vs {b}"
    else:
        assert a == b, f"{where}: {a} vs {b}"


def record_state(rec: Any) -> tuple[Any, ...]:
    return rec.round, rec.clients, rec.closed_by, rec.clipped, rec.clip_checked, rec.uplink_bytes
