"""Differential privacy (protofl/privacy.py): the accountant against dp-accounting's own figure and the exact one,
clipping and noise on the device, the config's refusals, and a spent budget that stops a run."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant as rdp

from protofl import privacy
from protofl.errors import ConfigError
from protofl.presets import make_config
from protofl.wire import ProtoUpload, RoundStart
from tests.edge_agent.test_agent import setup, start_round


def exact_gaussian_epsilon(noise: float, rounds: int, delta: float) -> float:
    """The exact epsilon of `rounds` Gaussian mechanisms of multiplier `noise` (sensitivity 1): their composition is
    one Gaussian mechanism of multiplier noise / sqrt(rounds), whose delta(eps) is Balle & Wang's (2018, thm. 8)
    Phi(1/(2s) - eps s) - e^eps Phi(-1/(2s) - eps s); solved for eps by bisection."""
    s = noise / math.sqrt(rounds)

    def phi(x: float) -> float:  # the standard normal's CDF
        return 0.5 * math.erfc(-x / math.sqrt(2))

    def delta_of(eps: float) -> float:
        return phi(1 / (2 * s) - eps * s) - math.exp(eps) * phi(-1 / (2 * s) - eps * s)

    lo, hi = 0.0, 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if delta_of(mid) > delta else (lo, mid)
    return hi


@pytest.mark.parametrize(("noise", "rounds"), [(1.0, 1), (2.0, 10), (0.8, 50), (5.0, 200)])
def test_accountant_reports_the_library_figure_and_bounds_the_exact_one(noise: float, rounds: int) -> None:
    delta = 1e-5
    acc = rdp.RdpAccountant()  # the library's own figure, composed here rather than through the module
    acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(noise), rounds))
    library = acc.get_epsilon(delta)
    ours = privacy.epsilon_after(noise, rounds, delta)
    assert ours == pytest.approx(library, rel=1e-9)
    exact = exact_gaussian_epsilon(noise, rounds, delta)
    # RDP is an upper bound on the exact epsilon, and a close one for the Gaussian (at most ~35 % above here).
    assert exact <= ours <= 1.35 * exact


def test_calibrated_noise_spends_the_budget_over_the_rounds() -> None:
    z = privacy.calibrate(4.0, 1e-5, 20)
    assert privacy.epsilon_after(z, 20, 1e-5) == pytest.approx(4.0, rel=1e-4)
    assert privacy.epsilon_after(z * 1.01, 20, 1e-5) < 4.0  # and no less noise would do
    cfg = make_config("fedproto", dp_epsilon=4.0, rounds=20)
    dp = privacy.resolve(cfg, cfg.draft)
    assert dp is not None and dp.noise == pytest.approx(z)
    assert privacy.stop_reason(dp, 19) is None  # 20 rounds fit the budget exactly
    assert dp.rows == 10 and dp.sensitivity == pytest.approx(2 * 1.0 * math.sqrt(10))


def test_a_run_stops_before_the_round_that_would_overspend() -> None:
    dp = privacy.DpSettings(epsilon=3.0, delta=1e-5, clip=1.0, noise=2.0, rows=1)
    # one Gaussian of z = 2 spends 2.17 at 1e-5, two 3.19 (the RDP figures)
    assert privacy.stop_reason(dp, 0) is None
    why = privacy.stop_reason(dp, 1)
    assert why is not None and "round 2 would make it 3.19 > dp_epsilon 3" in why


def test_clipping_bounds_each_row_and_keeps_those_inside() -> None:
    rows = np.array([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]])
    out = privacy.clip_rows(rows, 1.0)
    assert np.allclose(out, [[0.6, 0.8], [0.3, 0.4], [0.0, 0.0]])  # 5 -> 1 along its direction; 0.5 and 0 kept


def test_noise_has_the_calibrated_spread_and_counts_travel_as_one() -> None:
    rng = np.random.default_rng(12345)
    rows = {c: np.full(51, 10.0) for c in range(10)}  # norm 71.4: each clipped to 2.0, i.e. 0.28 per value
    counts = {c: 100 + c for c in range(10)}
    std = 0.5
    samples = []
    for _ in range(200):
        out, sent_counts = privacy.privatize(rows, counts, std, 2.0, rng)
        assert sent_counts == {c: 1 for c in range(10)}
        samples.append(np.stack([out[c] for c in range(10)]))
    noise = np.stack(samples) - 2.0 / math.sqrt(51)  # 102,000 values
    # mean 0 and std 0.5 within 5 standard errors (se of the mean 0.0016, of the std 0.0011)
    assert abs(noise.mean()) < 5 * std / math.sqrt(noise.size)
    assert noise.std() == pytest.approx(std, abs=5 * std / math.sqrt(2 * noise.size))


def test_a_distributed_share_adds_up_to_the_whole_variance() -> None:
    dp = privacy.DpSettings(epsilon=1.0, delta=1e-5, clip=1.0, noise=1.5, rows=4)
    assert dp.std == pytest.approx(1.5 * 2 * 2)
    assert 100 * dp.share_std(100) ** 2 == pytest.approx(dp.std**2)


def test_a_device_adds_its_share_of_the_noise_under_distributed_dp() -> None:
    # z 1.5, C 1, R 4: the sum's std is 1.5 * 2 * 1 * sqrt(4) = 6; local: each device adds all 6; distributed over at
    # least min_clients = 4 devices: each adds 6 / sqrt(4) = 3, and four shares add up to 4 * 9 = 36 = 6^2.
    local = privacy.DpSettings(epsilon=1.0, delta=1e-5, clip=1.0, noise=1.5, rows=4)
    shared = privacy.DpSettings(epsilon=1.0, delta=1e-5, clip=1.0, noise=1.5, rows=4, mode="distributed")
    assert local.device_std(4) == pytest.approx(6.0) and shared.device_std(4) == pytest.approx(3.0)
    with pytest.raises(ConfigError, match="min_clients >= 2"):
        make_config("fedproto", dp_epsilon=8.0, dp_noise=1.0, dp_mode="distributed", secagg=True, min_clients=1)
    cfg = make_config("fedproto", dp_epsilon=8.0, dp_noise=1.0, dp_mode="distributed", secagg=True, min_clients=4)
    assert cfg.dp_mode == "distributed" and cfg.to_dict()["secagg"] is True


def test_config_refuses_what_dp_does_not_cover() -> None:
    with pytest.raises(ConfigError, match="ridge=false"):
        make_config("protofl", dp_epsilon=8.0)  # the ridge statistics would travel without noise
    with pytest.raises(ConfigError, match="prototype uploads only"):
        make_config("refprotofl", dp_epsilon=8.0)  # APUD adapters
    with pytest.raises(ConfigError, match="secure aggregation"):
        make_config("fedproto", dp_epsilon=8.0, dp_mode="distributed")
    with pytest.raises(ConfigError, match="dp_epsilon is not"):
        make_config("fedproto", dp_noise=1.0)
    with pytest.raises(ConfigError, match="dp_delta"):
        make_config("fedproto", dp_epsilon=8.0, dp_delta=1.5)
    cfg = make_config("protofl", dp_epsilon=8.0, ridge=False)
    assert cfg.to_dict()["dp_noise"] == pytest.approx(privacy.calibrate(8.0, 1e-5, cfg.rounds))
    assert "dp_epsilon" not in make_config("fedproto").to_dict()  # off: the config travels as before


def test_the_device_clips_and_noises_what_it_sends() -> None:
    plain = setup("fedproto")
    start_round(plain[1], plain[2], 1, RoundStart(deadline=0.0))
    base = plain[4][1][1]
    assert isinstance(base, ProtoUpload) and base.local is not None
    clip, noise = 0.5, 0.2
    _, broker, server, agent, uploads = setup("fedproto", dp_epsilon=50.0, dp_noise=noise, dp_clip=clip)
    agent._noise = np.random.default_rng(7)  # (the OS's entropy otherwise)
    start_round(broker, server, 1, RoundStart(deadline=0.0))
    up = uploads[1][1]
    assert isinstance(up, ProtoUpload) and up.local is not None
    assert up.n_samples == 1 and up.local.counts is not None and up.local.counts.tolist() == [1, 1]
    assert up.local.classes.tolist() == base.local.classes.tolist()  # the label set still shows
    clipped = privacy.clip_rows(base.local.values, clip)
    assert np.linalg.norm(base.local.values, axis=1).min() > clip  # the rows were clipped, not just noised
    std = noise * 2 * clip * math.sqrt(3)  # z * 2 C sqrt(R), R = 3 classes
    residual = up.local.values.astype(np.float64) - clipped
    assert abs(residual.std() - std) < 0.35 * std  # 32 values: the sample std within ~4 of its standard errors
