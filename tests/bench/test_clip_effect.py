"""bench.clip_effect: the paired on - off figures and the clipped share, on hand-computed numbers."""

from __future__ import annotations

from bench import clip_effect


def test_paired_difference_mean_interval_and_signs() -> None:
    # differences 10, 0, -10 points: mean 0, sd 10, half width t(2) * 10 / sqrt(3) = 4.303 * 5.7735 = 24.84
    assert clip_effect.paired([0.5, 0.6, 0.7], [0.4, 0.6, 0.8]) == "+0.00 [-24.84, +24.84] (+0-)"


def test_clip_share_per_round_and_in_total() -> None:
    rep = {
        "simulation": {"clip": "on"},
        "rounds": [
            {"clipped": {}, "clip_checked": {"protos": 10}},
            {"clipped": {"protos": 3}, "clip_checked": {"protos": 10}},
        ],
    }
    assert clip_effect.clip_share(rep) == "0/10 3/10 (15.0 % of 20)"
    assert clip_effect.clip_share({"simulation": {"clip": "off"}, "rounds": []}) == "off"
