"""The device halves of the techniques (torch), one module each, found through entry points.

A `DeviceRule` is one technique's part of a device's round; the agent names none of them and calls the
hooks below on the active rules, in the plan's rule order (protofl/technique.py has the server half and
docs/design.md the whole contract). Every hook has a do-nothing default:

- `model_options`: what the technique needs of the model (e.g. a consensus projection);
- `decode_targets`: turn the round message's target table into the dense table training uses (a chain);
- `objective`: the training objective from the dense targets (the first rule with one owns it);
- `local_prototypes` / `select_local` / `encode_table`: the prototype upload (mean or unit prototypes,
  which classes travel, how a table is put on the wire);
- `phase_upload` / `public_prototypes`: uploads of their own (a first phase, the public set's prototypes);
- `vector` / `sparsifier`: the parameter vector upload and how it is made sparse;
- `state` / `load_state`: what a rule keeps between rounds (checkpointed with the device).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from protofl.algorithms.fedproto import nearest_prototype
from protofl.config import FederationConfig
from protofl.errors import ConfigError
from protofl.plan import Phase, RoundPlan
from protofl.wire import Config, ProtoSet, ProtoUpload

if TYPE_CHECKING:
    from edge_agent.models import ProtoNet

GROUP = "protofl.device_rules"

__all__ = ["GROUP", "DeviceContext", "DeviceRule", "Objective", "Sparsifier", "device_rules", "model_options",
           "rules_for"]


@dataclass
class DeviceContext:
    """What a rule may read while it handles a round: the federation, this device's model and data."""

    cfg: FederationConfig
    plan: RoundPlan
    model: ProtoNet
    device: torch.device
    embed: Callable[[Any], np.ndarray]  # features z of an array of inputs, in eval mode
    x: torch.Tensor  # the local training inputs
    y: np.ndarray  # their labels
    public_x: torch.Tensor | None = None  # the server's public set, where the federation has one
    public_y: np.ndarray | None = None
    masks: np.ndarray | None = None  # the support masks of the config message, where prototypes use them
    global_adapter: np.ndarray | None = None
    adapter_round: int = -1


class Objective:
    """The local training objective of a round, and how the trained model classifies for the metrics.

    The default: cross-entropy of the head; the head's softmax; no nearest-prototype prediction."""

    fixed_head = False  # whether the head stays as it is during local training
    # How features compare with the dense targets when a device classifies by nearest prototype ("l2" or
    # "cosine"); None: this objective classifies with the head only. A device's deployable prototypes
    # (edge_agent/artifacts.py) carry it.
    metric: str | None = None

    def loss(self, z: torch.Tensor, y: torch.Tensor, head: torch.nn.Module) -> torch.Tensor:
        return F.cross_entropy(head(z), y)

    def probabilities(self, model: ProtoNet, z: np.ndarray) -> np.ndarray:
        from edge_agent.extractor import class_probabilities

        return class_probabilities(model, z)

    def nearest_correct(self, z: np.ndarray, y: np.ndarray, probs: np.ndarray) -> int | None:
        """Correct predictions of the nearest target prototype; None where there are no targets."""
        return None

    def table(self) -> dict[int, np.ndarray]:
        """The dense targets (what a checkpoint keeps to rebuild the objective)."""
        return {}


class AlignmentObjective(Objective):
    """Cross-entropy plus lambda times the one alignment term of docs/algorithms.md: the per-element squared
    error between z and its class's dense target, mean over the batch and the m dims; a sample whose class
    has no target adds zero but still counts in the batch."""

    metric = "l2"

    def __init__(self, targets: dict[int, np.ndarray], num_classes: int, dim: int, weight: float,
                 device: torch.device | str = "cpu") -> None:
        self.targets = targets
        self.weight = weight
        values = torch.zeros(num_classes, dim)
        present = torch.zeros(num_classes, dtype=torch.bool)
        for c, v in targets.items():
            values[c] = torch.from_numpy(np.asarray(v, dtype=np.float32))
            present[c] = True
        self.values, self.present = values.to(device), present.to(device)

    def loss(self, z: torch.Tensor, y: torch.Tensor, head: torch.nn.Module) -> torch.Tensor:
        return F.cross_entropy(head(z), y) + self.weight * alignment(z, y, self.values, self.present)

    def nearest_correct(self, z: np.ndarray, y: np.ndarray, probs: np.ndarray) -> int | None:
        if not self.targets:
            return None
        if len(y) == 0:
            return 0
        return int((nearest_prototype(z, self.targets) == y).sum())

    def table(self) -> dict[int, np.ndarray]:
        return self.targets


def alignment(z: torch.Tensor, y: torch.Tensor, targets: torch.Tensor, has_target: torch.Tensor) -> torch.Tensor:
    """A(z, a) = (1/|B|) sum_i (1/m) ||z_i - a_{y_i}||^2 over the batch B; targets (C, m), has_target (C,).

    Every method aligns on this scale (docs/algorithms.md, "One alignment term"): one paper's summed form
    made lambda = 1 512x the cross-entropy and training collapsed to chance."""
    keep = has_target[y].to(z.dtype)
    per_sample = ((z - targets[y]) ** 2).mean(dim=1)
    return (per_sample * keep).sum() / z.shape[0]


@dataclass
class Sparsifier:
    """How a parameter vector travels sparse: the default K and the top-K selection for a K."""

    k: int
    select: Callable[[np.ndarray, np.ndarray | None, int], Any]


class DeviceRule:
    """One technique's device half for one federation (built when the config arrives)."""

    name = ""

    def __init__(self, cfg: FederationConfig, plan: RoundPlan, config: Config) -> None:
        self.cfg = cfg
        self.plan = plan

    def model_options(self) -> dict[str, Any]:
        return {}

    # -- targets and training -------------------------------------------------------------------
    def decode_targets(self, table: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        return table

    def objective(self, ctx: DeviceContext, table: dict[int, np.ndarray], fresh: bool) -> Objective | None:
        """The objective for these dense targets (`fresh`: from a round message, not a checkpoint)."""
        return None

    # -- uploads --------------------------------------------------------------------------------
    def local_prototypes(self, z: np.ndarray, y: np.ndarray) -> tuple[dict[int, np.ndarray], dict[int, int] | None] | None:
        return None

    def select_local(self, protos: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        return protos

    def encode_table(self, protos: dict[int, np.ndarray], counts: dict[int, int] | None,
                     role: str) -> tuple[dict[int, np.ndarray], dict[int, int] | None]:
        """A table on its way to the wire; `role` is "local" (this device's data) or "public"."""
        return protos, counts

    def phase_upload(self, ctx: DeviceContext, phase: Phase, pack: Packer) -> ProtoUpload | None:
        """The upload of a phase other than training (the first rule with one sends it)."""
        return None

    def public_prototypes(self, ctx: DeviceContext, pack: Packer) -> ProtoSet | None:
        """Public-set prototypes that travel with the training upload."""
        return None

    def vector(self, ctx: DeviceContext) -> np.ndarray | None:
        return None

    def sparsifier(self, theta: np.ndarray) -> Sparsifier | None:
        return None

    # -- state ------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {}

    def load_state(self, state: dict[str, Any]) -> None:
        pass


Packer = Callable[[dict[int, np.ndarray], "dict[int, int] | None", str], ProtoSet]


@functools.cache
def device_rules() -> dict[str, type[DeviceRule]]:
    """Every installed device rule, by technique name."""
    found: dict[str, type[DeviceRule]] = {}
    for ep in entry_points(group=GROUP):
        try:
            cls = ep.load()
        except Exception as exc:  # a broken third-party package: say which, not a bare traceback
            raise ConfigError(f"device rule '{ep.name} = {ep.value}' (entry point group {GROUP}) does not load: "
                              f"{type(exc).__name__}: {exc}; fix or uninstall the package that brings it") from exc
        if not (isinstance(cls, type) and issubclass(cls, DeviceRule)):
            raise ConfigError(f"entry point '{ep.name} = {ep.value}' in group {GROUP} is not a DeviceRule")
        found.setdefault(ep.name, cls)
    return found


def rules_for(cfg: FederationConfig, plan: RoundPlan, config: Config) -> list[DeviceRule]:
    """The device rules of the plan's active techniques, in rule order; a technique installed on the server
    but not here is an error that says what to install."""
    known = device_rules()
    missing = [name for name in plan.techniques if name not in known]
    if missing:
        raise ConfigError(f"this federation uses technique(s) {missing} that this device has no rule for: "
                          f"install the package that brings them here too")
    return [known[name](cfg, plan, config) for name in plan.techniques]


def model_options(cfg: FederationConfig) -> dict[str, Any]:
    """What the active techniques need of a model built for `cfg` (e.g. a consensus projection): what a
    device's model has, for those that rebuild one outside a federation (the simulator's global predictor,
    the export tool reading a federation's artifacts)."""
    options: dict[str, Any] = {}
    for rule in rules_for(cfg, RoundPlan.from_config(cfg), Config(preset=cfg.preset, params=cfg.to_dict())):
        options.update(rule.model_options())
    return options
