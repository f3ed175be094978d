"""The device halves of the techniques (torch), one module each, found through entry points.

A `DeviceRule` is one technique's part of a device's round; the agent names none of them and calls the
hooks below on the active rules, in the plan's rule order (protofl/technique.py has the server half and
docs/design.md the whole contract). Every hook has a do-nothing default:

- `model_options`: what the technique needs of the model (e.g. a consensus projection);
- `decode_targets`: turn the round message's target table into the dense table training uses (a chain);
- `classifier` / `loss_terms`: the round's training objective (`make_objective`), asked of every active rule
  whether or not the round carries targets. At most one rule owns the `Classifier` (how features become
  class scores and probabilities, through which head, fixed or trained, and its classification loss; the
  default is the linear head with cross-entropy); every rule may add `LossTerm`s (an alignment term, an
  entropy regulariser, a pull towards the parameters the round started from). The loss is the
  classifier's, then each term added in rule order;
- `local_prototypes` / `select_local` / `encode_table`: the prototype upload (mean or unit prototypes,
  which classes travel, how a table is put on the wire);
- `phase_upload` / `public_prototypes`: uploads of their own (a first phase, the public set's prototypes);
- `vector` / `vector_dtype` / `sparsifier`: the parameter vector upload, its fixed dtype, and how it is made sparse;
- `on_round`: a round message arrived (every one, the final one too, before any training): e.g. the global model
  it carries (the ridge predictor's route); `global_model`: the whole model vector of the federation's global
  predictor this rule holds, where it refreshes the shared backbone;
- `state` / `load_state`: what a rule keeps between rounds (checkpointed with the device).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from edge_agent.training import trainer
from edge_agent.training.models import head_probabilities
from protofl import registry
from protofl.algorithms.prototypes import nearest_prototype
from protofl.config import FederationConfig
from protofl.errors import ConfigError
from protofl.plan import Phase, RoundPlan
from protofl.sparse import SparseVector
from protofl.wire import Config, ProtoSet, ProtoUpload, RoundStart

if TYPE_CHECKING:
    from edge_agent.training.models import ProtoNet

GROUP = "protofl.device_rules"

log = logging.getLogger("edge_agent.techniques")

__all__ = [
    "GROUP",
    "AlignmentTerm",
    "Batch",
    "Classifier",
    "DeviceContext",
    "DeviceRule",
    "LossTerm",
    "NearestTargetClassifier",
    "Objective",
    "Sparsifier",
    "alignment",
    "device_rules",
    "make_objective",
    "model_options",
    "rules_for",
]


@dataclass
class DeviceContext:
    """What a rule may read while it handles a round: the federation, this device's model and data."""

    cfg: FederationConfig
    plan: RoundPlan
    model: ProtoNet
    device: torch.device
    embed: Callable[[Any], np.ndarray]  # features z of an array of inputs, in eval mode
    # The local training inputs: a tensor, or (a `join`) the uint8 images normalised per batch (trainer.rows reads
    # either; np.asarray(x) normalises them all).
    x: trainer.Inputs
    y: np.ndarray  # their labels
    public_x: torch.Tensor | None = None  # the server's public set, where the federation has one
    public_y: np.ndarray | None = None
    # The federation's shared backbone (the whole vector of its first architecture's model), where the public
    # message carried one (protofl/algorithms/ridge.py).
    backbone: np.ndarray | None = None
    # The normalisation the backbone's inputs take ((mean, std) per channel; None: this device's own), and this
    # device's own (what `x` is normalised with).
    backbone_norm: tuple[list[float], list[float]] | None = None
    data_norm: tuple[Sequence[float], Sequence[float]] | None = None
    masks: np.ndarray | None = None  # the support masks of the config message, where prototypes use them


@dataclass
class Batch:
    """One training step as the classifier prepared it: what its loss and every loss term read."""

    z: torch.Tensor  # the features of the batch
    y: torch.Tensor  # their labels
    head: torch.nn.Module
    head_input: torch.Tensor  # what the head scores: z, or a classifier's transform of it (e.g. z / ||z||)
    # The batch's logits against the class prototypes, where the classifier scores by them (None: it does not).
    prototype_logits: torch.Tensor | None = None


class Classifier:
    """How features become class scores and probabilities, and the classification loss on them.

    At most one active rule owns it (`DeviceRule.classifier`). The default: the linear head on z, trained,
    cross-entropy of its logits, its softmax for the metrics, no nearest-prototype prediction."""

    fixed_head = False  # whether the head stays as it is during local training
    # How features compare with the dense targets when a device classifies by nearest prototype ("l2" or
    # "cosine"); None: this classifier predicts with the head only. A device's deployable prototypes
    # (edge_agent/core/artifacts.py) carry it.
    metric: str | None = None

    def batch(self, z: torch.Tensor, y: torch.Tensor, head: torch.nn.Module) -> Batch:
        return Batch(z=z, y=y, head=head, head_input=z)

    def loss(self, batch: Batch) -> torch.Tensor:
        return F.cross_entropy(batch.head(batch.head_input), batch.y)

    def probabilities(self, model: ProtoNet, z: np.ndarray) -> np.ndarray:
        return head_probabilities(model, z)

    def nearest_correct(self, z: np.ndarray, y: np.ndarray, probs: np.ndarray) -> int | None:
        """Correct predictions of the nearest target prototype; None where it predicts by none."""
        return None

    def table(self) -> dict[int, np.ndarray]:
        """The prototypes it predicts by, with `metric` (none by default)."""
        return {}


class NearestTargetClassifier(Classifier):
    """The linear head, and the nearest dense target by L2 (FedProto's inference) beside it."""

    metric = "l2"

    def __init__(self, targets: dict[int, np.ndarray]) -> None:
        self.targets = targets

    def nearest_correct(self, z: np.ndarray, y: np.ndarray, probs: np.ndarray) -> int | None:
        if not self.targets:
            return None
        if len(y) == 0:
            return 0
        return int((nearest_prototype(z, self.targets) == y).sum())

    def table(self) -> dict[int, np.ndarray]:
        return self.targets


class LossTerm:
    """One term of a round's objective: a scalar from a batch (and whatever the rule gave it), added to the
    classifier's loss. A term keeps no state that training changes."""

    def loss(self, batch: Batch) -> torch.Tensor:
        raise NotImplementedError


class Objective:
    """A round's local training objective: the classifier's loss plus every term, added in that order,
    and how the trained model classifies for the metrics (the classifier's).

    `Objective()` is the default: cross-entropy of the head, no terms."""

    def __init__(
        self,
        classifier: Classifier | None = None,
        terms: Sequence[LossTerm] = (),
        targets: Mapping[int, np.ndarray] | None = None,
    ) -> None:
        self.classifier = classifier if classifier is not None else Classifier()
        self.terms = tuple(terms)
        self.targets = dict(targets or {})  # the dense table it was built from

    @property
    def fixed_head(self) -> bool:
        return self.classifier.fixed_head

    @property
    def metric(self) -> str | None:
        return self.classifier.metric

    def loss(self, z: torch.Tensor, y: torch.Tensor, head: torch.nn.Module) -> torch.Tensor:
        batch = self.classifier.batch(z, y, head)
        total = self.classifier.loss(batch)
        for term in self.terms:
            total = total + term.loss(batch)
        return total

    def probabilities(self, model: ProtoNet, z: np.ndarray) -> np.ndarray:
        return self.classifier.probabilities(model, z)

    def nearest_correct(self, z: np.ndarray, y: np.ndarray, probs: np.ndarray) -> int | None:
        """Correct predictions of the nearest target prototype; None where there are no targets."""
        return self.classifier.nearest_correct(z, y, probs)

    def table(self) -> dict[int, np.ndarray]:
        """The dense targets (what a checkpoint keeps to rebuild the objective): the prototypes the
        classifier predicts by, where it has some, else the table the objective was built from."""
        return self.classifier.table() or self.targets


class AlignmentTerm(LossTerm):
    """lambda times the one alignment term of docs/algorithms.md: the per-element squared error between z
    and its class's dense target, mean over the batch and the m dims; a sample whose class has no target
    adds zero but still counts in the batch. Shared by every mean-prototype technique."""

    def __init__(
        self,
        targets: dict[int, np.ndarray],
        num_classes: int,
        dim: int,
        weight: float,
        device: torch.device | str = "cpu",
    ) -> None:
        self.weight = weight
        values = torch.zeros(num_classes, dim)
        present = torch.zeros(num_classes, dtype=torch.bool)
        for c, v in targets.items():
            values[c] = torch.from_numpy(np.asarray(v, dtype=np.float32))
            present[c] = True
        self.values, self.present = values.to(device), present.to(device)

    def loss(self, batch: Batch) -> torch.Tensor:
        return self.weight * alignment(batch.z, batch.y, self.values, self.present)


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

    def classifier(self, ctx: DeviceContext, table: dict[int, np.ndarray], fresh: bool) -> Classifier | None:
        """The classifier of the round's objective, if this rule owns it (at most one active rule may), for
        these dense targets (empty where the round carries none; `fresh`: from a round message, not a
        checkpoint: a rule may set the model up for the round, e.g. anchor the head)."""
        return None

    def loss_terms(self, ctx: DeviceContext, table: dict[int, np.ndarray], fresh: bool) -> Sequence[LossTerm]:
        """This rule's terms of the round's objective (asked after every rule's `classifier`)."""
        return ()

    # -- uploads --------------------------------------------------------------------------------
    def local_prototypes(
        self, z: np.ndarray, y: np.ndarray
    ) -> tuple[dict[int, np.ndarray], dict[int, int] | None] | None:
        return None

    def select_local(self, protos: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        return protos

    def encode_table(
        self, protos: dict[int, np.ndarray], counts: dict[int, int] | None, role: str
    ) -> tuple[dict[int, np.ndarray], dict[int, int] | None]:
        """A table on its way to the wire; `role` is "local" (this device's data) or "public"."""
        return protos, counts

    def phase_upload(self, ctx: DeviceContext, phase: Phase, pack: Packer) -> ProtoUpload | None:
        """The upload of a phase other than training (the first rule with one sends it)."""
        return None

    def public_prototypes(self, ctx: DeviceContext, pack: Packer) -> ProtoSet | None:
        """Public-set prototypes that travel with the training upload."""
        return None

    def vector(self, ctx: DeviceContext) -> np.ndarray | SparseVector | None:
        return None

    def vector_dtype(self) -> str | None:
        """The wire dtype its vector must travel in whatever the budget (None: the plan's, leaner if need be)."""
        return None

    def sparsifier(self, theta: np.ndarray) -> Sparsifier | None:
        return None

    # -- round messages ---------------------------------------------------------------------------
    def on_round(self, ctx: DeviceContext, round_: int, msg: RoundStart) -> None:
        """A round message for round `round_` (the final one too), before this device trains on it (if it does)."""

    def global_model(self) -> np.ndarray | None:
        """The whole model vector of the federation's global predictor that this rule keeps up to date (the shared
        backbone with its head), or None: the shared backbone as the public message shipped it."""
        return None

    # -- state ------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {}

    def load_state(self, state: dict[str, Any]) -> None:
        pass


Packer = Callable[[dict[int, np.ndarray], "dict[int, int] | None", str], ProtoSet]


@functools.cache
def device_rules() -> dict[str, type[DeviceRule]]:
    """Every installed device rule that loads, by technique name. protofl-edge's own that does not load is an error
    (a broken install); another package's is named in a warning and skipped (`skipped_rules`), as the server's
    registry skips a technique (protofl/registry.py): only a federation that uses it is refused."""
    found: dict[str, type[DeviceRule]] = {}
    _SKIPPED.clear()
    eps = list(entry_points(group=GROUP))
    own = [ep for ep in eps if _dist_name(ep) in (registry.OWN_DIST, None)]
    for ep in [*own, *sorted((ep for ep in eps if ep not in own), key=lambda ep: (ep.name, ep.value))]:
        if ep.name in found:
            continue
        try:
            cls = ep.load()
            why = "" if isinstance(cls, type) and issubclass(cls, DeviceRule) else "it is not a DeviceRule"
        except Exception as exc:  # a broken package: say which, not a bare traceback
            why = f"it does not load: {type(exc).__name__}: {exc}"
        if why and ep in own:
            raise ConfigError(f"device rule '{ep.name} = {ep.value}' (entry point group {GROUP}): {why}")
        if why:
            _SKIPPED[ep.name] = f"device rule '{ep.name} = {ep.value}' (entry point group {GROUP}) was skipped: {why}"
            log.warning("%s; fix or uninstall the package that brings it", _SKIPPED[ep.name])
            continue
        found[ep.name] = cls
    return found


_SKIPPED: dict[str, str] = {}  # technique -> why its device rule was skipped (filled by `device_rules`)


def _dist_name(ep: Any) -> str | None:
    dist = getattr(ep, "dist", None)
    return None if dist is None else str(dist.name)


def rules_for(cfg: FederationConfig, plan: RoundPlan, config: Config) -> list[DeviceRule]:
    """The device rules of the plan's active techniques, in rule order; a technique installed on the server
    but not here is an error that says what to install. A technique that devices need nothing of
    (`Technique.device_free`) has no rule here unless one is installed."""
    known = device_rules()
    used = [name for name in plan.techniques if name in known or not registry.technique(name).device_free]
    missing = [name for name in used if name not in known]
    if missing:
        why = "".join(f"; {_SKIPPED[name]}" for name in missing if name in _SKIPPED)
        raise ConfigError(
            f"this federation uses technique(s) {missing} that this device has no rule for: "
            f"install the package that brings them here too{why}"
        )
    return [known[name](cfg, plan, config) for name in used]


def make_objective(
    rules: Sequence[DeviceRule], ctx: DeviceContext, table: dict[int, np.ndarray], fresh: bool
) -> Objective:
    """The round's objective from the active rules, in rule order: the classifier of the one that owns it
    (else the head's), then every rule's loss terms. Each rule is asked, targets or none (a term may need
    none); a classifier set up for the round (`fresh`) is in place before any term is built."""
    owners = [(rule, c) for rule in rules if (c := rule.classifier(ctx, table, fresh)) is not None]
    if len(owners) > 1:
        raise ConfigError(
            f"techniques {[rule.name for rule, _ in owners]} each own this round's classifier; at "
            f"most one may: turn one of them off"
        )
    terms = [term for rule in rules for term in rule.loss_terms(ctx, table, fresh)]
    return Objective(owners[0][1] if owners else None, terms, table)


def model_options(cfg: FederationConfig) -> dict[str, Any]:
    """What the active techniques need of a model built for `cfg` (e.g. a consensus projection): what a
    device's model has, for those that rebuild one outside a federation (the simulator's global predictor,
    the export tool reading a federation's artifacts)."""
    options: dict[str, Any] = {}
    for rule in rules_for(cfg, RoundPlan.from_config(cfg), Config(preset=cfg.preset, params=cfg.to_dict())):
        options.update(rule.model_options())
    return options
