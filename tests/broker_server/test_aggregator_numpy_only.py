"""The aggregator's service path runs with torch unimportable: every preset, two full rounds.

Fake clients (numpy only) answer each round message with valid uploads of the kind the preset needs.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import importlib.abc, sys

    class NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError("torch is blocked in this test")
            return None

    sys.meta_path.insert(0, NoTorch())

    import numpy as np
    from broker_server.core.shell import Aggregator
    from protofl import topics
    from protofl.algorithms import apud
    from tests.wire_helpers import ridge_upload
    from protofl.presets import PRESETS, make_config
    from protofl.transport import InProcessBroker
    from protofl.wire import (ParamsUpload, Join, ProtoSet, ProtoUpload, RoundStart, decode_message,
                              encode_message)

    def protoset(classes, width, rng, counts=True, unit=False):
        v = rng.standard_normal((len(classes), width)).astype(np.float32)
        if unit:
            v /= np.linalg.norm(v, axis=1, keepdims=True)
        return ProtoSet(classes=np.array(classes), values=v,
                        counts=np.full(len(classes), 5) if counts else None)

    for preset in PRESETS:
        cfg = make_config(preset, rounds=2, num_classes=4, proto_dim=20, adapter_rank=2, cps_s=5,
                          public_classes=(0, 1))
        broker = InProcessBroker()
        ids = ["a", "b", "c"]
        init = np.zeros(1000, np.float32) if cfg.federate == "full" else None
        agg = Aggregator(cfg, "np", broker.connect("server"), expected_clients=ids, initial_params=init)
        agg.start()
        rng = np.random.default_rng(0)
        width = agg.machine.plan.proto_width

        def on_round(topic, payload, cid):
            env, msg = decode_message(payload)
            if msg.final:
                return
            out = []
            if env.phase == "proto":
                out.append(ProtoUpload(public=protoset([0, 1], width, rng, counts=False),
                                       local=protoset([2, 3], width, rng, counts=not cfg.scaling), n_samples=10))
            else:
                if cfg.federate == "full":
                    out.append(ParamsUpload(update=rng.standard_normal(1000).astype(np.float32), n_samples=10,
                                             base_round=env.round))
                elif cfg.federate == "adapter":
                    adapter = agg.model.rules.state_values()["adapter"]
                    d = adapter.shape[0]
                    local = adapter + rng.standard_normal(d).astype(np.float32)
                    out.append(ParamsUpload(update=apud.select_topk(local, adapter, 30), n_samples=10,
                                             base_round=env.round))
                elif agg.machine.plan.shared_backbone:  # the ridge predictor's statistics (the protofl preset)
                    out.append(ridge_upload(cfg, env.round, 10, rng))
                if cfg.prototypes != "none" and not cfg.erpa:
                    unit = cfg.prototypes == "unit"
                    out.append(ProtoUpload(local=protoset([0, 2], width, rng,
                                                          counts=not (cfg.scaling or unit), unit=unit),
                                           public=None, n_samples=10))
            for m in out:
                broker.connect(cid).publish(topics.up("np", cid), encode_message(
                    m, fed="np", sender=cid, round=env.round, phase=env.phase))

        for cid in ids:
            broker.connect(cid).subscribe(topics.round_("np"), lambda t, p, cid=cid: on_round(t, p, cid))
            broker.connect(cid).publish(topics.up("np", cid), encode_message(
                Join(arch="cnn", n_samples=10), fed="np", sender=cid))
        broker.pump()
        assert agg.finished, (preset, agg.round, agg.dropped)
        assert agg.dropped == {}, (preset, agg.dropped)
        assert [r.clients for r in agg.records] == [ids, ids], preset
        print(preset, "ok")

    assert "torch" not in sys.modules
    """
)


def test_every_preset_aggregates_two_rounds_without_torch() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(" ok") == 6, proc.stdout
