"""The agent as a function: an input in (config, public set, round message, re-send request), an `Outcome` out.

No broker and no carrier here: each test hands the agent encoded messages as they would arrive and checks what
it answers - the sends (kind, topic, round, phase, bytes), whether the checkpointed state changed, a failure,
the refused inputs - and that a refused input leaves the state as it was.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from edge_agent.core.agent import EdgeAgent
from edge_agent.core.emulation import Emulation, RoundClock
from edge_agent.core.outcome import Drop, Outcome
from edge_agent.ops.resume import restore_agent, save_agent
from protofl import topics
from protofl.adapter import adapter_layout, initial_adapter
from protofl.algorithms import cps
from protofl.config import FederationConfig
from protofl.presets import make_config
from protofl.profiles import load_device
from protofl.wire import Config, Join, Metrics, RoundStart, decode_message, encode_message
from tests.edge_agent.test_agent import FED, tiny_data

UP = topics.up(FED, "dev1")


def config_payload(preset: str, **overrides: Any) -> tuple[bytes, FederationConfig]:
    cfg = make_config(
        preset,
        num_classes=3,
        proto_dim=16,
        adapter_rank=2,
        in_shape=(1, 6, 6),
        archs=("mlp",),
        batch_size=8,
        cps_s=4,
        public_classes=(0,),
        **overrides,
    )
    masks = cps.make_masks(3, 16, 4, seed=0) if cfg.cps else None
    layout = adapter_layout(16, 2, 3) if cfg.federate == "adapter" else []
    msg = Config(preset=preset, params=cfg.to_dict(), adapter_layout=layout, class_masks=masks)
    return encode_message(msg, fed=FED, sender="server"), cfg


def round_payload(r: int, phase: str = "train", **fields) -> bytes:
    return encode_message(RoundStart(deadline=0.0, **fields), fed=FED, sender="server", round=r, phase=phase)


def configured(preset: str, **options) -> EdgeAgent:
    agent = EdgeAgent("dev1", FED, tiny_data(), **options)
    payload, _ = config_payload(preset)
    out = agent.receive(topics.config(FED), payload)
    assert out.configured and out.sends == () and out.drops == () and agent.model is not None
    return agent


def weights(agent: EdgeAgent) -> dict[str, torch.Tensor]:
    assert agent.model is not None
    return {k: v.clone() for k, v in agent.model.state_dict().items()}


def test_join_is_one_send_on_the_devices_upload_topic() -> None:
    agent = EdgeAgent("dev1", FED, tiny_data(), profile="rpi4")
    out = agent.join()
    assert out.kinds() == ["join"] and out.sends[0].topic == UP and out.sends[0].key == (0, "")
    env, msg = decode_message(out.sends[0].payload)
    assert isinstance(msg, Join)
    assert env.sender == "dev1" and msg.n_samples == 40 and msg.profile == "rpi4"
    assert not out.changed and out.failure is None


@pytest.mark.parametrize(
    "preset,uploads", [("fedavg", ["adapter"]), ("fedproto", ["protos"]), ("tinyproto", ["protos"])]
)
def test_a_training_round_message_in_gives_its_uploads_and_metrics_out(preset: str, uploads: list[str]) -> None:
    agent = configured(preset)
    out = agent.receive(topics.round_(FED), round_payload(1))
    assert out.kinds() == [*uploads, "metrics"]  # exactly the plan's uploads, then the round's metrics
    assert all(s.topic == UP and s.key == (1, "train") and s.not_before == 0.0 for s in out.sends)
    assert [decode_message(s.payload)[0].kind for s in out.sends] == out.kinds()  # the kind is the wire kind
    assert out.changed and out.trained and out.failure is None and out.drops == () and not out.resent
    assert out.nbytes == agent.stats.uploaded_bytes == sum(len(s.payload) for s in out.sends)


def test_a_two_phase_round_sends_each_phases_own_upload() -> None:
    agent = configured("refprotofl")
    theta = initial_adapter(adapter_layout(16, 2, 3), seed=0)
    out = agent.receive(topics.round_(FED), round_payload(1, "proto", adapter=theta))
    assert out.kinds() == ["protos"] and out.sends[0].key == (1, "proto") and out.changed and not out.trained
    out = agent.receive(topics.round_(FED), round_payload(1, "train"))
    assert out.kinds() == ["adapter", "metrics"] and out.trained


def test_the_same_round_message_again_trains_nothing_and_a_runner_sends_the_same_bytes() -> None:
    sim, dev = configured("fedproto"), configured("fedproto", resends=True)
    first = {a: a.receive(topics.round_(FED), round_payload(1)) for a in (sim, dev)}
    # The simulator's agent: nothing is lost in-process, a repeated round message is nothing to do.
    assert sim.receive(topics.round_(FED), round_payload(1)) == Outcome()
    # A runner's agent: the uploads again (not the metrics), the very bytes sent first; nothing trained or saved.
    again = dev.receive(topics.round_(FED), round_payload(1))
    assert again.resent == "announced again" and again.kinds() == ["protos"]
    assert again.sends[0].payload == first[dev].sends[0].payload
    assert not again.changed and not again.trained and dev.stats.rounds_trained == 1


def test_a_resend_request_in_gives_the_same_bytes_out() -> None:
    agent = configured("fedproto", resends=True)
    sent = agent.receive(topics.round_(FED), round_payload(1)).sends
    bytes_before = agent.stats.uploaded_bytes
    out = agent.resend("uploads", 1, "train")
    assert out.resent == "asked again by the server" and [s.payload for s in out.sends] == [sent[0].payload]
    out = agent.resend("metrics", 1, "")
    assert out.kinds() == ["metrics"] and out.sends[0].payload == sent[1].payload
    assert agent.resend("uploads", 2, "train") == Outcome()  # a round it has not handled: nothing
    assert agent.resend("metrics", 2, "") == Outcome()
    assert agent.stats.uploaded_bytes == bytes_before  # re-sends are not new uploads
    # Only the last round message's uploads are kept, and the metrics of the last two rounds.
    for r in (2, 3):
        agent.receive(topics.round_(FED), round_payload(r))
    assert agent.resend("uploads", 2, "train") == Outcome()
    assert agent.resend("uploads", 3, "train").kinds() == ["protos"]
    assert agent.resend("metrics", 1, "") == Outcome() and agent.resend("metrics", 2, "").kinds() == ["metrics"]
    assert agent.resend("join", 0, "").kinds() == ["join"]


def test_what_was_sent_survives_a_checkpoint(tmp_path) -> None:
    agent = configured("fedproto", resends=True)
    sent = agent.receive(topics.round_(FED), round_payload(1)).sends
    path = tmp_path / "dev1.ckpt"
    save_agent(path, agent, agent.last_key, [(s.topic, s.payload) for s in agent.sent])
    restarted = configured("fedproto", resends=True)
    got = restore_agent(path, restarted)
    assert got is not None
    restarted.restore_sent(*got)
    out = restarted.receive(topics.round_(FED), round_payload(1))  # the retained round message, after the restart
    assert out.resent == "announced again" and [(s.kind, s.payload) for s in out.sends] == [("protos", sent[0].payload)]


def test_a_bad_config_in_is_a_refusal_out_and_the_state_is_unchanged() -> None:
    agent = configured("fedproto")
    agent.receive(topics.round_(FED), round_payload(1))
    cfg, model, before = agent.cfg, agent.model, weights(agent)
    assert cfg is not None
    for hostile in (cfg.replace(lr=1e30), cfg.replace(in_shape=(3, 32, 32))):
        payload = encode_message(
            Config(preset="fedproto", params=hostile.to_dict(), adapter_layout=[]), fed=FED, sender="server"
        )
        out = agent.receive(topics.config(FED), payload)
        assert not out.configured and out.sends == () and not out.changed
        assert [d.reason for d in out.drops] == ["bad_config"] and "keeping the previous config" in out.drops[0].detail
        assert agent.cfg == cfg and agent.model is model and (1, "train") in agent.handled
        assert all(torch.equal(before[k], v) for k, v in weights(agent).items())
    # A config that is no msgpack at all, and one of another federation: refused, nothing else.
    assert agent.receive(topics.config(FED), b"\x00nope").drops[0].reason == "malformed"
    other = encode_message(Config(preset="fedproto", params=cfg.to_dict(), adapter_layout=[]), fed="x", sender="s")
    assert agent.receive(topics.config(FED), other).drops == (Drop("wrong_fed", "message for federation 'x'"),)
    assert agent.cfg == cfg and agent.model is model


def test_a_first_config_this_device_cannot_afford_leaves_it_without_a_model() -> None:
    agent = EdgeAgent("dev1", FED, tiny_data())
    _, cfg = config_payload("fedproto")
    payload = encode_message(
        Config(preset="fedproto", params=cfg.replace(num_classes=65535, proto_dim=65536).to_dict(), adapter_layout=[]),
        fed=FED,
        sender="server",
    )
    out = agent.receive(topics.config(FED), payload)
    assert out.drops[0].reason == "bad_config" and "65535 * 65536" in out.drops[0].detail
    assert agent.cfg is None and agent.model is None and not out.configured
    assert agent.receive(topics.round_(FED), round_payload(1)) == Outcome()  # no config, no round


def test_hostile_anchors_are_refused_and_marked_handled() -> None:
    from protofl.wire import ProtoSet

    agent = configured("fedproto")
    before = weights(agent)
    huge = ProtoSet(classes=np.array([0, 1]), values=np.full((2, 16), 1.5e38, np.float32), counts=None)
    out = agent.receive(topics.round_(FED), round_payload(1, targets=huge, target_label="mean"))
    assert out.sends == () and [d.reason for d in out.drops] == ["bad_round"]
    assert out.changed and not out.trained  # handled: the same message would be refused again
    assert all(torch.equal(before[k], v) for k, v in weights(agent).items())


def test_the_final_round_message_finishes_once_with_the_artifacts_asked_for() -> None:
    agent = configured("fedproto", artifacts_at=("final",))
    first = agent.receive(topics.round_(FED), round_payload(1))
    assert first.artifacts is None  # not asked for before training
    out = agent.receive(topics.round_(FED), round_payload(2, "done", final=True))
    assert out.finished and agent.finished and out.sends == () and not out.changed
    assert out.artifacts is not None and out.artifacts.final and out.artifacts.rounds_trained == 1
    assert agent.receive(topics.round_(FED), round_payload(2, "done", final=True)) == Outcome()


def test_with_a_device_profile_uploads_wait_for_the_emulated_compute_and_metrics_carry_the_timings() -> None:
    clock = RoundClock(Emulation(device=load_device("rpi4"), time_scale=10.0, emulate_compute=True))
    agent = configured("fedproto", clock=clock, resends=True)
    out = agent.receive(topics.round_(FED), round_payload(1), recv_t=1000.0)
    upload, metrics = out.sends
    assert upload.not_before == clock.release_t and upload.not_before > 0 and metrics.not_before == 0.0
    sent = decode_message(metrics.payload)[1]
    assert isinstance(sent, Metrics) and sent.extra["recv_t"] == 1000.0 and sent.extra["release_t"] == clock.release_t
    # Sent again, the upload is still held to the round's release time.
    assert agent.resend("uploads", 1, "train").sends[0].not_before == clock.release_t
