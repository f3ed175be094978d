"""The federation's deployable artifacts from the server's model (broker_server/core/artifacts.py, numpy only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from broker_server.core.artifacts import write_server_artifacts
from broker_server.core.stages import build_model
from protofl import artifacts as art
from protofl.algorithms.fedavg import FederatedVector
from protofl.algorithms.fedproto import MeanPrototypes
from protofl.plan import RoundPlan
from protofl.presets import make_config

SMALL: dict[str, Any] = dict(num_classes=3, proto_dim=16, adapter_rank=2)


def server_model(preset: str, **overrides: Any):
    cfg = make_config(preset, **SMALL, **overrides)
    return build_model(cfg, RoundPlan.from_config(cfg))


def test_masked_prototypes_are_written_at_full_width_with_their_masks(tmp_path: Path) -> None:
    model = server_model("tinyproto", cps_s=4)
    # TinyProto's global prototypes live on the wire as their s = 4 values on each class's mask
    protos = model.rules.state(MeanPrototypes).prototypes = {
        0: np.array([1, 2, 3, 4], np.float32),
        2: np.array([5, 6, 7, 8], np.float32),
    }
    masks = model.rules.support_masks()
    write_server_artifacts(model, tmp_path, fed="f", round_=3, finished=False, class_names=["a", "b", "c"])
    got = art.read_prototypes(tmp_path / "global" / art.PROTOTYPES)
    assert got.classes.tolist() == [0, 2] and got.values.shape == (2, 16) and got.class_names == ("a", "c")
    for row, c in zip(got.values, (0, 2), strict=True):  # expanded onto the class's mask, zero elsewhere
        assert np.array_equal(row[masks[c]], protos[c]) and not row[~masks[c]].any()
    assert got.metric == "cosine"  # scaled sums: only their direction is the federation's
    with np.load(tmp_path / "global" / art.PROTOTYPES, allow_pickle=False) as f:
        assert np.array_equal(f["masks"].astype(bool), masks)
    manifest = art.read_json(tmp_path / art.MANIFEST)
    assert manifest["round"] == 3 and not manifest["finished"] and manifest["fed"] == "f"
    assert manifest["predictor"]["kind"] is None and manifest["federated"] is None
    assert not (tmp_path / "global" / art.FEDERATED).exists()


def test_a_federated_adapter_is_written_and_the_manifest_says_whether_it_is_a_predictor(tmp_path: Path) -> None:
    for backbone, predictor in (("train", None), ("frozen", "adapter")):
        model = server_model("refprotofl", public_classes=(0,), backbone=backbone)
        model.rules.state(FederatedVector).adapter = np.arange(10, dtype=np.float32)
        out = tmp_path / backbone
        write_server_artifacts(
            model, out, fed="f", round_=1, finished=True, data="fashion-mnist", norm=((0.286,), (0.353,))
        )
        vector, kind = art.read_vector(out / "global" / art.FEDERATED)
        assert kind == "adapter" and np.array_equal(vector, np.arange(10, dtype=np.float32))
        manifest = art.read_json(out / art.MANIFEST)
        assert manifest["federated"] == "adapter" and manifest["predictor"]["kind"] == predictor
        assert manifest["norm_mean"] == [0.286] and manifest["data"] == "fashion-mnist"
        assert manifest["class_names"] == ["0", "1", "2"]
        assert not (out / "global" / art.PROTOTYPES).exists()  # no anchors before a first phase
