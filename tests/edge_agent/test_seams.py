"""The device's seams (issue 55): the federation's sealing stages, built once from its config, and parameter
federation as a rule chosen by the plan's `federate`."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from edge_agent.core.device_config import read_config
from edge_agent.core.sealing import Outgoing, PrivacyNoise
from edge_agent.core.secagg_device import Masking
from edge_agent.training import param_federation as param_federation_module
from edge_agent.training.models import build_model
from edge_agent.training.param_federation import ParamFederation, param_federation, register
from protofl.errors import ConfigError
from protofl.presets import make_config
from protofl.wire import Config, Envelope, Join, ProtoSet, ProtoUpload, SaKeys, SaRoster

SMALL: dict[str, Any] = dict(num_classes=3, proto_dim=4, in_shape=(1, 6, 6), archs=("mlp",), adapter_rank=2)


def _read(preset: str, **overrides):
    cfg = make_config(preset, **SMALL, **overrides)
    return read_config(Config(preset=preset, params=cfg.to_dict()))


def test_the_stages_follow_the_config_privacy_noise_then_masking() -> None:
    assert _read("fedproto").stages == ()
    assert [type(s) for s in _read("fedproto", secagg=True, min_clients=2).stages] == [Masking]
    assert [type(s) for s in _read("fedproto", dp_epsilon=8.0, dp_noise=1.0).stages] == [PrivacyNoise]
    both = _read("fedproto", dp_epsilon=8.0, dp_noise=1.0, dp_mode="distributed", secagg=True, min_clients=4)
    assert [type(s) for s in both.stages] == [PrivacyNoise, Masking]
    noise, masking = both.stages
    assert isinstance(noise, PrivacyNoise) and isinstance(masking, Masking) and both.dp is not None
    # distributed: each device adds a 1/min_clients share of the variance, to its rows and to those it lacks
    assert noise.std == pytest.approx(both.dp.std / 2) and masking.absent_std == pytest.approx(both.dp.std / 2)
    assert both.samples_sent(40) == 1 and _read("fedproto").samples_sent(40) == 40  # DP: the count stays here


def test_privacy_noise_clips_and_noises_prototype_uploads_only() -> None:
    (stage,) = _read("fedproto", dp_epsilon=8.0, dp_noise=1e-9, dp_clip=1.0).stages
    table = ProtoSet.from_table({0: np.array([3.0, 4, 0, 0]), 2: np.array([0.6, 0, 0, 0])}, 4, counts={0: 5, 2: 7})
    up = Outgoing(ProtoUpload(local=table, public=None, n_samples=1), "f", "d", 1, "train")
    sealed = stage.seal(up, np.random.default_rng(0)).msg
    assert isinstance(sealed, ProtoUpload) and sealed.local is not None and sealed.local.counts is not None
    # |(3, 4)| = 5 clipped to 1: (0.6, 0.8); (0.6, 0) inside the ball; the noise is ~1e-9 * 2 * 1 * sqrt(3)
    assert np.allclose(sealed.local.values, [[0.6, 0.8, 0, 0], [0.6, 0, 0, 0]], atol=1e-6)
    assert sealed.local.counts.tolist() == [1, 1] and sealed.local.classes.tolist() == [0, 2]
    join = Outgoing(Join(arch="mlp", n_samples=3), "f", "d", 0, "")
    assert stage.seal(join, np.random.default_rng(0)) is join


def test_masking_keeps_the_table_sends_its_keys_and_answers_its_own_steps_only() -> None:
    (stage,) = _read("fedproto", secagg=True, min_clients=2).stages
    assert isinstance(stage, Masking)
    env = Envelope(v=1, kind=SaRoster.KIND, fed="f", round=1, phase="train", sender="server", msg_id="", body={})
    roster = SaRoster(keys={}, t=2, frac_bits=16, bound=1.0, weighted=True)
    before = stage.answer(env, roster)
    assert before is not None and before.drop is not None and before.drop.reason == "stale"  # nothing masked yet
    table = ProtoSet.from_table({0: np.ones(4)}, 4, counts={0: 2})
    up = Outgoing(ProtoUpload(local=table, public=None, n_samples=2), "f", "d", 1, "train")
    sealed = stage.seal(up, np.random.default_rng(0))
    assert isinstance(sealed.msg, SaKeys) and stage.run is not None and stage.run.table is table
    assert stage.answer(env, ProtoUpload(local=None, public=None, n_samples=1)) is None  # not one of its steps


@pytest.mark.parametrize(("federate", "base"), [("none", 5), ("adapter", 3), ("full", 5)])
def test_each_way_of_sharing_names_its_parameters_and_its_base_round(federate: str, base: int) -> None:
    model = build_model("mlp", (1, 6, 6), 3, 4, 2, seed=0)
    rule = param_federation(federate)
    assert rule.name == federate and rule.base_round(3, 5) == base
    shared = rule.shared_parameters(model)
    if federate == "adapter":
        assert shared == [*model.adapter.parameters(), *model.head.parameters()]
        assert rule.base_round(-1, 5) == -1  # no global adapter held yet: nothing to train from
    else:
        assert shared == list(model.parameters())
    assert (rule.vector(model) is None) == (federate == "none")
    assert rule.scores_test_set == (federate != "full")  # the aggregate's accuracy, not the device's, where full


def test_a_way_of_sharing_is_a_plug_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(param_federation_module, "_RULES", dict(param_federation_module._RULES))  # (undone after)
    with pytest.raises(ConfigError, match="known: adapter, full, none"):
        param_federation("fedbn")

    class HeadOnly(ParamFederation):
        name = "head-only-test"

    register(HeadOnly())
    assert isinstance(param_federation("head-only-test"), HeadOnly)
