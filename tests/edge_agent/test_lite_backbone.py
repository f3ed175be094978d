"""The lite device's backbone (issue 57): the server's ONNX graph fed from the backbone's parameter vector gives the
torch backbone's features, and a lite device's ridge statistics are a torch device's (float32 tolerance); another
vector loaded into the same graph gives that vector's features (the weights are never frozen into the graph)."""

from __future__ import annotations

import numpy as np
import torch

from edge_agent.core.client_data import ClientData
from edge_agent.inference.lite_backbone import LiteBackbone
from edge_agent.ops.lite import LiteRunner
from edge_agent.ops.local_data import DataSpec
from edge_agent.training import params, trainer
from edge_agent.training.backbone import backbone_graph, backbone_model, renormalize
from protofl.algorithms.ridge import ridge_statistics
from protofl.data.dataset import Images
from protofl.presets import make_config
from protofl.transport.broker_url import parse_broker_url
from protofl.wire import PublicSet


def test_the_graph_fed_from_any_vector_is_the_torch_backbone(one_torch_thread: None) -> None:
    cfg = make_config("protofl")
    graph, layout = backbone_graph(cfg)
    assert len(graph) < 64 * 1024  # no weights inside: a few KB
    x = np.random.default_rng(0).standard_normal((70, *cfg.in_shape)).astype(np.float32)
    lite = LiteBackbone(graph, layout, threads=1)
    for seed in (0, 1):  # two different vectors, one graph
        model = backbone_model(cfg.replace(seed=seed))
        if seed:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01 * torch.randn_like(p))
        lite.load(params.full_vector(model))
        want = trainer.embed(model, torch.from_numpy(x))
        np.testing.assert_allclose(lite.embed(x, batch_size=32), want, rtol=1e-4, atol=1e-5)


def test_a_lite_device_s_statistics_are_a_torch_device_s(one_torch_thread: None) -> None:
    cfg = make_config("protofl")
    model = backbone_model(cfg)
    vector = params.full_vector(model)
    graph, layout = backbone_graph(cfg)
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, (300, *cfg.in_shape), dtype=np.uint8)
    y = rng.integers(0, cfg.num_classes, 300)
    own, to = ((0.3,), (0.4,)), ([0.28], [0.35])  # the device's normalisation, and the backbone's
    data = ClientData(
        x_train=Images(raw, *own), y_train=y, x_test=Images(raw[:5], *own), y_test=y[:5], mean=own[0], std=own[1]
    )
    runner = LiteRunner(parse_broker_url("mqtt://127.0.0.1:1"), "f", "pi", DataSpec("synthetic"))
    runner.cfg, runner.data = cfg, data
    runner.public = PublicSet(x=raw[:0], y=y[:0], classes=[], backbone=vector, norm=to, graph=graph, layout=layout)
    runner.backbone = LiteBackbone(graph, layout, threads=1)
    runner.backbone.load(vector)
    got = runner.ridge_statistics()
    # the torch device's rule (edge_agent/techniques/ridge.py): its features, its renormalisation
    feats = trainer.embed(model, data.x_train, transform=lambda xb: renormalize(xb, own, to))
    want = ridge_statistics(feats, y, cfg.num_classes)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * float(np.abs(want).max()))
