"""The federation's global model on the server's validation data, each round (torch, in a child process).

`protofl-server start --preset fedavg --validation DATA` scores FedAvg's global model every round as it scores the
global predictor of other presets; the server stays torch-free, so this child holds the model and the normalised
validation images for the whole run (torch imported once) and answers one request a round:

    python -m edge_agent.core.scorer CONFIG.json VAL.npz      (VAL: x uint8, mean, std)
    stdin:  a path to an .npy parameter vector (the model's, in params.full_vector's order), one a line
    stdout: one JSON line a request: {"predictions": [class id per image]} or {"error": "why"}

The model is the federation's first architecture built from its seed (what every device starts from), the
vector loaded into it, in eval mode.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from edge_agent.training import params as model_params
from edge_agent.training.backbone import normalize
from edge_agent.training.models import build_model
from protofl.config import FederationConfig

BATCH = 256


def predictions(model: torch.nn.Module, x: torch.Tensor) -> list[int]:
    out: list[int] = []
    with torch.inference_mode():
        for i in range(0, len(x), BATCH):
            out += model(x[i : i + BATCH]).argmax(1).tolist()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from edge_agent.techniques import model_options

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m edge_agent.core.scorer CONFIG.json VAL.npz", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    cfg = FederationConfig.from_dict(json.loads(Path(args[0]).read_text()))
    model = build_model(
        cfg.archs[0],
        cfg.in_shape,
        cfg.num_classes,
        cfg.proto_dim,
        cfg.adapter_rank,
        seed=cfg.seed,
        **model_options(cfg),
    ).eval()
    with np.load(args[1], allow_pickle=False) as z:
        x = torch.from_numpy(normalize(z["x"], z["mean"].tolist(), z["std"].tolist()))
    for line in sys.stdin:
        try:
            model_params.load_full_vector(model, np.load(line.strip(), allow_pickle=False).astype(np.float32))
            answer: dict[str, object] = {"predictions": predictions(model.eval(), x)}
        except (OSError, ValueError) as exc:
            answer = {"error": str(exc)}
        print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
