"""`--from ARTIFACT`: the model (and its prototype table) that a run's deployable artifacts describe.

Two kinds (protofl/artifacts.py):

* a device's (``devices/<id>/``): its own trained model, the prototype table it classifies with and the
  input normalisation it trained on; exported as the features graph, its table beside it;
* the federation's (``global/``, or the run's root): the model a new device gets -- the federation's first
  architecture (or ``--arch``: an own backbone; or ``--checkpoint``: own weights) built from the
  federation's seed as every device builds it, with the federated parameters loaded where the preset
  federates some (FedAvg's model, the adapter and head): how a device that joins late predicts before it
  trains. With global prototypes the graph is the features graph and the
  prototypes go beside it (nearest global prototype on its own backbone); without (FedAvg) it is the
  global predictor's classifier (``logits``); ``--what logits`` asks for the classifier where there are
  both.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from edge_agent.training import params as model_params
from edge_agent.training.models import ProtoNet, build_model
from export.checkpoint import load_checkpoint, load_model
from protofl import artifacts as art
from protofl.config import FederationConfig
from protofl.errors import ConfigError

__all__ = ["Loaded", "load_artifact"]


@dataclass(frozen=True)
class Loaded:
    model: ProtoNet
    what: str  # the graph to export by default: "features" (with `prototypes`) or "logits"
    prototypes: art.PrototypeFile | None
    class_names: list[str] | None
    norm: tuple[tuple[float, ...], tuple[float, ...]] | None  # the inputs' mean/std where recorded
    data: str | None  # the data spec the run used, where recorded (verify/quantize/bench default to it)
    note: str  # what was loaded, in words
    prototypes_path: Path | None = None  # the file `prototypes` was read from
    csv_scaling: dict | None = None  # a CSV's per-column standardisation the model was trained with


def _norm(info: dict) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    if info.get("norm_mean") and info.get("norm_std"):
        return tuple(float(v) for v in info["norm_mean"]), tuple(float(v) for v in info["norm_std"])
    return None


def _device(a: art.Artifact, arch: str | None, checkpoint: str | os.PathLike[str] | None) -> Loaded:
    if checkpoint is not None:
        raise ConfigError("--from a device's artifact brings its own weights; drop --checkpoint")
    model = load_model(arch, a.model)
    _, spec = load_checkpoint(a.model)
    protos = art.read_prototypes(a.prototypes) if a.prototypes.is_file() else None
    info = a.info
    note = (
        f"device {info.get('client_id', a.path.name)} of federation '{info.get('fed')}' "
        f"({info.get('preset')}), {info.get('rounds_trained', '?')} round(s) trained"
    )
    return Loaded(
        model.eval(),
        "features",
        protos,
        a.class_names,
        _norm(spec),
        info.get("data"),
        note,
        a.prototypes if protos is not None else None,
        info.get("csv_scaling"),
    )


def _predictor(a: art.Artifact, cfg: FederationConfig) -> Loaded:
    """The federation's global predictor: its head (global/predictor.npz) on the shared backbone."""
    from edge_agent.training.backbone import backbone_model

    w, b, backbone, info = art.read_predictor(a.predictor)
    try:
        model = backbone_model(cfg, backbone)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if tuple(model.head.weight.shape) != w.shape:
        raise ConfigError(
            f"{a.predictor}: a head of shape {w.shape} does not fit the federation's {model.arch} model "
            f"{tuple(model.head.weight.shape)}"
        )
    with torch.no_grad():
        model.head.weight.copy_(torch.from_numpy(w))
        model.head.bias.copy_(torch.from_numpy(b))
    when = f"after round {a.info['round']}" if "round" in a.info else f"as device {a.info.get('client_id')} kept it"
    made = (
        f"a {info.get('kind')} head from {info['devices']} device(s)' statistics ({info.get('samples', '?')} samples)"
        if "devices" in info
        else "its global head"
    )
    note = (
        f"the global predictor of federation '{a.info.get('fed')}' ({cfg.preset}) {when}: {made} on the shared "
        f"{model.arch} backbone ({info.get('backbone', 'shipped')})"
    )
    norm = _norm(info) or _norm(a.info)  # the backbone's inputs' (shipped with it), else the run's data's
    if norm is None and a.model.is_file():  # a device's copy: the normalisation its data had
        norm = _norm(load_checkpoint(a.model)[1])
    # The global prototypes live in the devices' own feature spaces, not the backbone's: they do not go with it.
    return Loaded(model.eval(), "logits", None, a.class_names, norm, a.info.get("data"), note)


def _global(a: art.Artifact, arch: str | None, checkpoint: str | os.PathLike[str] | None) -> Loaded:
    from edge_agent.techniques import model_options

    cfg = FederationConfig.from_dict(dict(a.info["config"]))
    if a.predictor.is_file() and arch is None and checkpoint is None:
        return _predictor(a, cfg)
    name = arch or cfg.archs[0]
    if checkpoint is not None:
        model = load_model(
            arch,
            checkpoint,
            in_shape=cfg.in_shape,
            num_classes=cfg.num_classes,
            proto_dim=cfg.proto_dim,
            adapter_rank=cfg.adapter_rank,
        )
    else:  # what a device of this federation starts from (edge_agent.core.agent, on_config)
        model = build_model(
            name, cfg.in_shape, cfg.num_classes, cfg.proto_dim, cfg.adapter_rank, seed=cfg.seed, **model_options(cfg)
        )
    kind = None
    if a.federated.is_file():  # what the round message gives a device that joins now
        vector, kind = art.read_vector(a.federated)
        try:
            if kind == "model":
                model_params.load_full_vector(model, vector)
            else:
                model_params.load_adapter_vector(model, vector)
        except ValueError as exc:
            raise ConfigError(
                f"the federation's global {kind} does not fit a {model.arch} model ({exc}); it was "
                f"trained on {cfg.archs[0]}: drop --arch/--checkpoint"
            ) from None
    protos = art.read_prototypes(a.prototypes) if a.prototypes.is_file() else None
    if kind is None and protos is None:
        raise ConfigError(
            f"{a.path} holds neither global prototypes nor federated parameters yet (a federation "
            "before its first round); export a device's artifact instead (--device ID)"
        )
    round_ = a.info.get("round", "?")
    weights = f"weights from {checkpoint}" if checkpoint else "initial weights"
    if kind is not None:
        weights += f" + the global {kind}"
    predictor = a.info.get("predictor") or {}
    note = (
        f"a new device of federation '{a.info.get('fed')}' ({cfg.preset}) after round {round_}: {model.arch} "
        f"{weights}"
        + (", global prototypes" if protos is not None else "")
        + ("" if predictor.get("kind") else f" (no global predictor: {predictor.get('reason', '')})")
    )
    return Loaded(
        model.eval(),
        "features" if protos is not None else "logits",
        protos,
        a.class_names,
        _norm(a.info),
        a.info.get("data"),
        note,
        a.prototypes if protos is not None else None,
    )


def load_artifact(
    path: str | os.PathLike[str],
    *,
    device: str | None = None,
    arch: str | None = None,
    checkpoint: str | os.PathLike[str] | None = None,
) -> Loaded:
    """The model and prototype table named by `--from PATH` (and `--device`, `--arch`, `--checkpoint`)."""
    try:
        a = art.resolve(Path(path), device)
    except ValueError as exc:  # DataError: say it as the CLI's input error
        raise ConfigError(str(exc)) from None
    if a.kind == "predictor":
        if arch is not None or checkpoint is not None:
            raise ConfigError("--from a global predictor brings its own backbone; drop --arch/--checkpoint")
        return _predictor(a, FederationConfig.from_dict(dict(a.info["config"])))
    return _device(a, arch, checkpoint) if a.kind == "device" else _global(a, arch, checkpoint)
