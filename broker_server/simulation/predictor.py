"""The global predictor's accuracy in a simulation: one model a new device could be given, on the test set.

Where the config defines one (protofl.artifacts.predictor_kind): FedAvg's aggregated model, the federated
adapter and head on the frozen backbone every device holds alike (RefProtoFL's theta^{a,T} on a shared
backbone), or a global head on the shared backbone the public message ships (the ridge predictor,
protofl/algorithms/ridge.py: `ServerRule.predictor_head`). The simulator scores it, not a device: it is a
function of the server's agreed state after each round, which no device holds until the next round message,
and one evaluation per round costs less than one per device. torch (the simulation runs the devices anyway);
never on the service path.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from broker_server.core.stages import ServerModel
from protofl import artifacts
from protofl.config import FederationConfig
from protofl.data import Dataset
from protofl.plan import Phase

__all__ = ["GlobalPredictor"]


class GlobalPredictor:
    """Scores the server model's global predictor; `kind` None (with `reason`) where the config has none."""

    def __init__(
        self,
        cfg: FederationConfig,
        test: Dataset,
        device: str = "cpu",
        batch_size: int = 512,
        backbone: np.ndarray | None = None,
    ) -> None:
        import torch

        from edge_agent.techniques import model_options
        from edge_agent.training import params as model_params
        from edge_agent.training.models import build_model

        self.kind, self.reason = artifacts.predictor_kind(cfg)
        self.initial_params: np.ndarray | None = None
        self.batch_size = batch_size
        self.y = test.y
        if self.kind is None:
            return  # nothing to build or score
        if self.kind == "head":  # the shared backbone the devices embedded their data with, and its plain head
            from edge_agent.training.backbone import backbone_model

            self.model = backbone_model(cfg, backbone)
        else:  # the model every device of the first architecture starts from (edge_agent.core.agent, on_config)
            self.model = build_model(
                cfg.archs[0],
                cfg.in_shape,
                cfg.num_classes,
                cfg.proto_dim,
                cfg.adapter_rank,
                seed=cfg.seed,
                **model_options(cfg),
            )
        if self.kind == "model":
            self.initial_params = model_params.full_vector(self.model)
        if self.kind == "adapter" and not isinstance(self.model.stem, torch.nn.Identity):
            self.kind, self.reason = (
                None,
                (
                    f"the {cfg.archs[0]} backbone gives {self.model.backbone_dim} values, "
                    f"not m = {cfg.proto_dim}: each device trains its own stem between "
                    "the backbone and the federated adapter"
                ),
            )
        if self.kind == "adapter" and self.model.projection is not None:
            self.kind, self.reason = None, "each device trains its own projection after the federated adapter"
        self.model.to(device).eval()
        x = torch.from_numpy(np.ascontiguousarray(test.normalized(), dtype=np.float32)).to(device)
        self.x = x
        self._h: Any = None
        if self.kind == "adapter":  # the backbone is frozen: its test features once, not every round
            with torch.inference_mode():
                self._h = (
                    torch.cat(
                        [self.model.backbone_features(x[i : i + batch_size]) for i in range(0, len(x), batch_size)]
                    )
                    if len(x)
                    else x
                )
        self._z: Any = None
        self._backbone_key: int | None = None  # which refreshed backbone `_z` is of (None: the shipped one)
        if self.kind == "head":  # the whole feature extractor is fixed: the test set's z once
            with torch.inference_mode():
                self._z = (
                    torch.cat([self.model.features(x[i : i + batch_size]) for i in range(0, len(x), batch_size)])
                    if len(x)
                    else x
                )

    def accuracy(self, server: ServerModel) -> float | None:
        """The global predictor's test accuracy for the server's current state (None: none, or none yet)."""
        import torch

        from edge_agent.training import params as model_params

        if self.kind == "head":
            return self._head_accuracy(server)
        final = server.rules.round_fields(Phase.DONE)  # the federated vector, as the final round message has it
        vector = final.params if self.kind == "model" else final.adapter if self.kind == "adapter" else None
        if vector is None:
            return None
        if self.kind == "model":
            model_params.load_full_vector(self.model, vector)
        else:
            model_params.load_adapter_vector(self.model, vector)
        self.model.eval()
        correct, n = 0, len(self.y)
        with torch.inference_mode():
            for i in range(0, n, self.batch_size):
                z = (
                    self.model.features_from_backbone(self._h[i : i + self.batch_size])
                    if self._h is not None
                    else self.model.features(self.x[i : i + self.batch_size])
                )
                pred = self.model.head(z).argmax(1).cpu().numpy()
                correct += int((pred == self.y[i : i + self.batch_size]).sum())
        return correct / n if n else 0.0

    def _head_accuracy(self, server: ServerModel) -> float | None:
        import torch

        head = server.rules.predictor_head()
        if head is None:
            return None
        refreshed = server.rules.predictor_backbone()  # the ridge predictor's route: g, refreshed by the devices
        if refreshed is not None:
            key = zlib.crc32(np.ascontiguousarray(refreshed, np.float32).tobytes())
            if key != self._backbone_key:
                from edge_agent.training import params as model_params

                model_params.load_full_vector(self.model, refreshed)
                self.model.eval()
                with torch.inference_mode():
                    bs, x = self.batch_size, self.x
                    self._z = (
                        torch.cat([self.model.features(x[i : i + bs]) for i in range(0, len(x), bs)]) if len(x) else x
                    )
                self._backbone_key = key
        with torch.no_grad():
            self.model.head.weight.copy_(torch.from_numpy(head[0]))
            self.model.head.bias.copy_(torch.from_numpy(head[1]))
        correct, n = 0, len(self.y)
        with torch.inference_mode():
            for i in range(0, n, self.batch_size):
                pred = self.model.head(self._z[i : i + self.batch_size]).argmax(1).cpu().numpy()
                correct += int((pred == self.y[i : i + self.batch_size]).sum())
        return correct / n if n else 0.0
