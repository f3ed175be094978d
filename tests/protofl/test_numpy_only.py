"""protofl.algorithms must run with torch unimportable: the aggregator's service path is numpy only."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import importlib, importlib.abc, pkgutil, sys

    class NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"torch is blocked in this test (tried to import {name})")
            return None

    sys.meta_path.insert(0, NoTorch())
    for name in [n for n in sys.modules if n == "torch" or n.startswith("torch.")]:
        del sys.modules[name]

    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("the torch blocker does not work")

    import numpy as np
    import protofl.algorithms as algorithms

    modules = sorted(m.name for m in pkgutil.iter_modules(algorithms.__path__))
    for name in modules:
        importlib.import_module(f"protofl.algorithms.{name}")
    expected = {"apud", "cps", "erpa", "fedavg", "fedproto", "fedpagr", "fedprox", "prototypes", "scaling", "support",
                "unit"}
    assert expected <= set(modules), modules

    from protofl.algorithms import apud, cps, erpa, fedavg, fedpagr, fedproto, prototypes, scaling, support, unit

    # one tiny full aggregation per accumulator
    agg = fedavg.FedAvgAggregator(3)
    agg.add(np.ones(3), 2)
    assert agg.result().shape == (3,)

    z = np.arange(12, dtype=np.float32).reshape(4, 3)
    protos, counts = prototypes.local_prototypes(z, np.array([0, 0, 1, 1]), 2)
    pa = fedproto.PrototypeAggregator(2, 3)
    pa.add(protos, counts)
    assert prototypes.nearest_prototype(z, pa.result()).tolist() == [0, 0, 1, 1]

    g = np.zeros(10, dtype=np.float32)
    aa = apud.ApudAggregator(g)
    aa.add(apud.select_topk(np.arange(10, dtype=np.float32), g, apud.topk_budget(10, 0.3)), 5)
    assert aa.result()[9] == 9.0

    ea = erpa.ErpaAggregator(3, 3, public_classes=[0])
    ea.add({0: np.ones(3)}, {1: protos[1]}, {1: counts[1]})
    assert sorted(ea.anchors()) == [0, 1]

    masks = cps.make_masks(2, 3, 1)
    comp = support.compress_table(protos, masks)
    sa = scaling.ScaledAggregator(2, 1)
    sa.add(scaling.scale_prototypes(comp, counts))
    sparse_globals = support.reconstruct_table(sa.result(), masks)
    cps.unpack_masks(cps.pack_masks(masks), 2, 3)

    ca = unit.ConsensusAggregator(unit.initial_prototypes(2, 3, seed=0))
    ca.add({c: unit.normalize_rows(p) for c, p in protos.items()})
    S, K = ca.sums()
    fedpagr.geometric_refine(ca.result(), S, K)
    fedpagr.refine_anchor_table(sparse_globals, masks)

    assert "torch" not in sys.modules, "torch was imported"
    print("ok", modules)
    """
)


def test_algorithms_run_without_torch():
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("ok")
