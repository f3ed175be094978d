"""The ridge predictor's route, device half (edge_agent/techniques/ridge.py), on the default preset's cnn: g kept bit
for bit from the round messages, the top-K update with error feedback, a device behind sends an empty vector; and the
route's uplink bytes over 50 rounds against FedAvg's, from the real encoded messages (protofl.wire.message_size)."""

from __future__ import annotations

import numpy as np
import torch

from edge_agent.techniques import DeviceContext
from edge_agent.techniques.ridge import RidgeDevice
from edge_agent.training import params as model_params
from edge_agent.training.backbone import backbone_model
from protofl.algorithms.ridge import is_stats_round, ridge_length, route_k
from protofl.plan import RoundPlan
from protofl.presets import make_config
from protofl.sparse import SparseVector
from protofl.wire import Config, ModelUpdate, ParamsUpload, RoundStart, message_size

ROUNDS, DEVICES = 50, 10


def _setup() -> tuple[RidgeDevice, DeviceContext, np.ndarray]:
    torch.manual_seed(0)
    cfg = make_config("protofl", ridge_topk=0.001)  # the opt-in route on the defaults: the cnn, ridge_every 10
    plan = RoundPlan.from_config(cfg)
    rule = RidgeDevice(cfg, plan, Config(preset=cfg.preset, params=cfg.to_dict()))
    model = backbone_model(cfg)
    backbone = model_params.full_vector(model)
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.normal(size=(40, *cfg.in_shape)).astype(np.float32))
    ctx = DeviceContext(
        cfg=cfg, plan=plan, model=model, device=torch.device("cpu"), embed=lambda a: np.zeros(0), x=x,
        y=rng.integers(0, 10, 40), backbone=backbone, backbone_norm=None, data_norm=None,
    )  # fmt: skip
    return rule, ctx, backbone


def _message(version: int, g_new: np.ndarray, changed: np.ndarray, dense: bool = False) -> RoundStart:
    idx = np.asarray(changed, np.int64)
    upd = SparseVector(g_new.shape[0], idx, g_new[idx].astype(np.float32))
    return RoundStart(deadline=1.0, model=ModelUpdate(version, upd, g_new if dense else None))


def test_the_device_keeps_g_sends_top_k_with_error_feedback_and_says_when_it_is_behind() -> None:
    rule, ctx, backbone = _setup()
    n = backbone.shape[0]
    k = route_k(n, 0.001)
    # Round 1 (statistics): g is the shipped backbone (version 0); the statistics are of its features.
    rule.on_round(ctx, 1, _message(0, backbone, np.zeros(0)))
    stats = rule.vector(ctx)
    assert isinstance(stats, np.ndarray) and stats.shape == (ridge_length(512, 10),)
    # Round 2's message: version 1, g's head replaced (its last 10 x 512 + 10 values): set bit for bit.
    g1 = backbone.copy()
    head = np.arange(n - 5130, n)
    g1[head] = np.linspace(-1, 1, head.size, dtype=np.float32)
    rule.on_round(ctx, 2, _message(1, g1, head))
    assert rule.version == 1 and rule.g is not None and rule.g.tobytes() == g1.tobytes() and not rule.behind
    sent = rule.vector(ctx)
    assert isinstance(sent, SparseVector) and sent.n == n and sent.nnz == k
    assert (np.diff(sent.indices) > 0).all() and sent.values.dtype == np.float32
    e = rule.residual
    assert e is not None and not e[sent.indices].any()  # e = delta - sent: 0 where sent
    # What was kept back is at most what was sent, entry by entry (top-K by magnitude).
    assert np.abs(e).max() <= np.abs(sent.values).min()
    # The state survives a checkpoint (g, its version, the residual).
    saved = rule.state()
    other, _, _ = _setup()
    other.load_state(saved)
    assert other.version == 1 and other.g is not None and other.g.tobytes() == g1.tobytes()
    assert other.residual is not None and other.residual.tobytes() == e.tobytes()
    # A round message of version 3 while we hold 1 (we missed version 2): behind, an empty update of g's length ...
    rule.on_round(ctx, 4, _message(3, g1, np.array([0])))
    assert rule.behind and rule.version == 1
    empty = rule.vector(ctx)
    assert isinstance(empty, SparseVector) and empty.n == n and empty.nnz == 0
    # ... until a message carries the whole g: version 3, bit for bit.
    g3 = g1.copy()
    g3[:3] += 1
    rule.on_round(ctx, 5, _message(3, g3, np.array([0]), dense=True))
    assert not rule.behind and rule.version == 3 and rule.g is not None and rule.g.tobytes() == g3.tobytes()


def test_the_route_s_uplink_over_50_rounds_is_at_most_a_hundredth_of_fedavg_s() -> None:
    rule, ctx, backbone = _setup()
    n = backbone.shape[0]
    rule.on_round(ctx, 1, _message(0, backbone, np.zeros(0)))
    stats = rule.vector(ctx)
    rule.on_round(ctx, 2, _message(1, backbone, np.zeros(0)))  # (an empty change: version 1 is g_0 here)
    update = rule.vector(ctx)
    assert isinstance(stats, np.ndarray) and isinstance(update, SparseVector)
    # The real messages: the statistics (f4, dense) and the update (f4, sparse) as the device sends them, and
    # FedAvg's whole model (the fedavg preset's dtype) of the same cnn.
    every = int(make_config("protofl").options["ridge_every"])
    stats_bytes = message_size(ParamsUpload(update=stats, n_samples=6000, base_round=1, dt="f4"), round=1)
    update_bytes = message_size(ParamsUpload(update=update, n_samples=6000, base_round=2, dt="f4"), round=2)
    fedavg = make_config("fedavg")
    fedavg_bytes = message_size(
        ParamsUpload(update=backbone, n_samples=6000, base_round=2, dt=fedavg.adapter_dtype), round=2
    )
    stats_rounds = sum(is_stats_round(r, every) for r in range(1, ROUNDS + 1))
    route = DEVICES * (stats_rounds * stats_bytes + (ROUNDS - stats_rounds) * update_bytes)
    base = DEVICES * ROUNDS * fedavg_bytes
    print(
        f"\ng = {n:,} values, K = {update.nnz}; per device: statistics {stats_bytes:,} B x {stats_rounds} rounds, "
        f"update {update_bytes:,} B x {ROUNDS - stats_rounds}; FedAvg {fedavg_bytes:,} B x {ROUNDS}; "
        f"{DEVICES} devices over {ROUNDS} rounds: route {route:,} B, FedAvg {base:,} B, ratio {route / base:.5f}"
    )
    assert stats_rounds == 5 and 540_000 < stats_bytes < 560_000 and update_bytes < 14_000
    assert route <= base / 100
