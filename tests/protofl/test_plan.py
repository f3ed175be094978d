"""The round plan: what each preset's switches mean for both sides, and the combinations refused."""

from __future__ import annotations

import pytest

from protofl.config import FederationConfig
from protofl.errors import ConfigError
from protofl.plan import Phase, RoundPlan, Upload
from protofl.presets import make_config
from tests.pipelines import ADAPTER_PIPELINE

A, P = Upload.ADAPTER, Upload.PROTOS

# preset -> (phases, uploads per phase, adapter carried by, active techniques, target label, prototype width)
EXPECTED = {
    "fedavg": ((Phase.TRAIN,), {Phase.TRAIN: (A,)}, None, ("fedavg",), "dense", 512),
    "fedproto": ((Phase.TRAIN,), {Phase.TRAIN: (P,)}, None, ("fedproto",), "dense", 512),
    "refprotofl": (
        (Phase.PROTO, Phase.TRAIN),
        {Phase.PROTO: (P,), Phase.TRAIN: (A,)},
        Phase.PROTO,
        ("fedavg", "apud", "fedproto", "erpa"),
        "dense",
        512,
    ),
    "tinyproto": ((Phase.TRAIN,), {Phase.TRAIN: (P,)}, None, ("fedproto", "cps"), "cps+scaled", 51),
    "fedpagr": ((Phase.TRAIN,), {Phase.TRAIN: (P,)}, None, ("fedpagr",), "unit", 512),
    # candidate (b) of setting D, spherical CPS (bench/results/TABLE.md chose it), and the ridge predictor (issue 41:
    # bench/results/PREDICTOR.md chose it), whose statistics ride the parameter upload
    "protofl": ((Phase.TRAIN,), {Phase.TRAIN: (P, A)}, None, ("fedpagr", "cps", "ridge"), "unit+cps", 51),
}


@pytest.mark.parametrize("preset", list(EXPECTED))
def test_each_preset_plan(preset: str) -> None:
    phases, uploads, adapter_phase, techniques, label, width = EXPECTED[preset]
    plan = RoundPlan.from_config(make_config(preset))
    assert plan.phases == phases
    assert {ph: plan.sends(ph) for ph in phases} == uploads
    assert plan.adapter_phase == adapter_phase
    assert plan.techniques == techniques and plan.target_label == label and plan.proto_width == width


def test_erpa_in_the_combined_pipeline_moves_prototypes_to_the_proto_phase() -> None:
    # public set on half the classes: the others are anchored by scaled prototypes (scaling acts)
    plan = RoundPlan.from_config(
        make_config("protofl", **{**ADAPTER_PIPELINE, "erpa": True}, public_classes=(0, 1, 2, 3, 4))
    )
    assert plan.sends(Phase.PROTO) == (P,) and plan.sends(Phase.TRAIN) == (A,)
    assert plan.public_phase is Phase.PROTO and plan.next_phase(Phase.PROTO) is Phase.TRAIN
    assert plan.next_phase(Phase.TRAIN) is None
    assert plan.target_label == "cps+scaled"  # scaling hides n_kc


@pytest.mark.parametrize(
    "overrides, reason",
    [
        (dict(preset="fedproto", refine=True), "with neither it changes nothing"),
        (dict(preset="fedavg", refine=True), "nothing to refine"),
        # 10 classes x s = 51 <= 512: disjoint masks, refinement is a no-op
        (dict(preset="refprotofl", cps=True, refine=True), "changes nothing: masked anchors are already orthogonal"),
        # every class public: ERPA anchors are public-set means, no client sends a scaled prototype
        (dict(preset="tinyproto", erpa=True), "scaling changes nothing with erpa"),
        # spherical CPS: 10 x 51 <= 512, disjoint masks, the unit prototypes are already orthogonal
        (dict(preset="fedpagr", cps=True), "spherical CPS prototypes whose masks do not overlap"),
        (dict(preset="fedpagr", scaling=True), "unit prototypes"),
        # ERPA on unit prototypes (candidate (d)) sends public prototypes with the training upload: exact
        # only while nothing federated changes the features in between
        (dict(preset="fedpagr", refine=False, erpa=True, federate="adapter"), "exact only when no adapter"),
        (dict(preset="fedpagr", erpa=True), "refinement of ERPA unit anchors is not built"),
    ],
)
def test_meaningless_switch_combinations_are_refused_with_a_reason(overrides: dict, reason: str) -> None:
    preset = overrides.pop("preset")
    with pytest.raises(ConfigError, match=reason):
        make_config(preset, **overrides)


def test_scaling_with_erpa_is_accepted_where_a_class_lacks_public_data() -> None:
    assert make_config("tinyproto", erpa=True, public_classes=(0, 1)).scaling
    assert make_config("tinyproto", erpa=True, public_per_class=0).scaling  # no public set: every class scaled


def test_refinement_is_accepted_where_it_acts() -> None:
    make_config("fedpagr", refine=True)  # unit prototypes
    make_config("refprotofl", refine=True)  # dense ERPA anchors
    make_config("refprotofl", cps=True, refine=True, cps_s=128)  # 10 x 128 > 512: masks overlap
    make_config("fedpagr", cps=True, cps_s=128)  # spherical CPS with overlapping masks (candidate (c))


def test_spherical_cps_sends_unit_prototypes_on_their_masks() -> None:
    plan = RoundPlan.from_config(make_config("fedpagr", cps=True, refine=False))
    assert plan.techniques == ("fedpagr", "cps") and plan.masked
    assert plan.proto_width == 51 and plan.target_label == "unit+cps"


def test_erpa_on_spherical_cps_is_one_phase_with_public_prototypes_in_the_training_upload() -> None:
    plan = RoundPlan.from_config(make_config("fedpagr", cps=True, refine=False, erpa=True))
    assert plan.phases == (Phase.TRAIN,) and plan.sends(Phase.TRAIN) == (P,) and plan.public_phase is Phase.TRAIN
    assert plan.target_label == "unit+cps" and plan.proto_width == 51
    assert plan.public_classes == tuple(range(10))
    assert RoundPlan.from_config(make_config("fedpagr", cps=True, refine=False)).public_phase is None
    assert RoundPlan.from_config(make_config("refprotofl")).public_phase is Phase.PROTO  # two phases


def test_limits_follow_the_model() -> None:
    small = RoundPlan.from_config(FederationConfig(federate="full", prototypes="none"))
    assert small.limits(1_000_000).max_message_bytes == 32 * 2**20  # never below the codec's default
    big = small.limits(11_200_000)  # resnet18: 44.8 MB of f4 per model message
    assert big.max_message_bytes >= 4 * 11_200_000 * 1.25 and big.max_elements > 11_200_000
    assert big.max_bin_len >= big.max_message_bytes
