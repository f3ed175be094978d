"""The federation's shared backbone: the model the ridge predictor's features come from (torch).

Trained once, where the public set is (`protofl-server simulate` in-process; `start --public-data` in a child
process, so that the server stays torch-free; or elsewhere with `python -m edge_agent.training.backbone`), then shipped
once to every device with the public set (`PublicSet.backbone`): every device embeds its data with the same
weights, and the global predictor is this model with the ridge head (protofl/algorithms/ridge.py).

The recipe is the benchmark's public-only model (bench/predictor_routes.py, "public"): the federation's first
architecture built from the config's seed (a plain linear head: no technique's model options), trained with
cross-entropy on the public set for `backbone_epochs` epochs of SGD with the config's lr, momentum, weight decay
and batch size, the batch order from the seed. Deterministic on one machine; the vector is what travels, so
devices never retrain it.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from edge_agent.training import params as model_params
from edge_agent.training import trainer
from edge_agent.training.models import ProtoNet, build_model
from protofl.config import FederationConfig
from protofl.data import Dataset
from protofl.data.federation import public_indices, with_shared_backbone
from protofl.plan import RoundPlan
from protofl.wire import PublicSet

__all__ = ["backbone_graph", "backbone_model", "cache_key", "train_backbone", "trained_backbone", "with_backbone"]

log = logging.getLogger("protofl.backbone")
PROGRESS = "shared backbone: "  # the lines `protofl-server start` shows of this child's output


def backbone_model(cfg: FederationConfig, vector: np.ndarray | None = None) -> ProtoNet:
    """The shared backbone's model: the first architecture from the config's seed, plain head, `vector` loaded
    where given (without one: the seeded initial model, random features)."""
    model = build_model(cfg.archs[0], cfg.in_shape, cfg.num_classes, cfg.proto_dim, cfg.adapter_rank, seed=cfg.seed)
    if vector is not None:
        try:
            model_params.load_full_vector(model, np.asarray(vector, np.float32))
        except ValueError as exc:
            raise ValueError(
                f"the federation's shared backbone does not fit a {cfg.archs[0]} model ({exc}): the server and this "
                f"device disagree on the architecture"
            ) from None
    return model.eval()


def renormalize(
    x: np.ndarray | torch.Tensor,
    frm: tuple[Sequence[float], Sequence[float]],
    to: tuple[Sequence[float], Sequence[float]] | None,
) -> torch.Tensor:
    """Inputs normalised with `frm` (a device's own mean/std), normalised instead with `to` (the backbone's: what it
    was trained on); `to` None: as they are."""
    xt = torch.as_tensor(x)
    same = to is not None and all(
        len(a) == len(b) and all(np.float32(u) == np.float32(v) for u, v in zip(a, b, strict=True))
        for a, b in zip(frm, to, strict=True)
    )
    if to is None or same:  # (the same normalisation: the inputs as they are, bit for bit)
        return xt
    shape = (1, -1, 1, 1)
    m0, s0 = torch.tensor(frm[0]).reshape(shape), torch.tensor(frm[1]).reshape(shape)
    m1, s1 = torch.tensor(to[0]).reshape(shape), torch.tensor(to[1]).reshape(shape)
    return ((xt * s0.to(xt) + m0.to(xt)) - m1.to(xt)) / s1.to(xt)


def normalize(x: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """uint8 (n, c, h, w) images as a device normalises them (float32 inputs pass through)."""
    if x.dtype != np.uint8:
        return np.asarray(x, np.float32)
    m = np.asarray(mean, np.float32).reshape(1, -1, 1, 1)
    s = np.asarray(std, np.float32).reshape(1, -1, 1, 1)
    return ((x.astype(np.float32) / 255.0 - m) / s).astype(np.float32)


def train_backbone(
    cfg: FederationConfig,
    x: np.ndarray,
    y: np.ndarray,
    mean: Sequence[float],
    std: Sequence[float],
    *,
    epochs: int | None = None,
    device: str = "cpu",
) -> np.ndarray:
    """The backbone's whole parameter vector (float32) after training on the public set (x, y)."""
    epochs = int(cfg.backbone_epochs if epochs is None else epochs)
    model = backbone_model(cfg).to(device)
    if epochs == 0 or len(y) == 0:
        return model_params.full_vector(model)
    xt = torch.from_numpy(normalize(x, mean, std)).to(device)
    yt = torch.from_numpy(np.asarray(y, np.int64)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    rng = np.random.default_rng([cfg.seed, 0xBAC])
    torch.manual_seed(cfg.seed)
    model.train()
    n, bs = len(yt), cfg.batch_size
    began = time.monotonic()
    for epoch in range(epochs):
        if epoch:  # progress: `start` passes these lines on (the broker and the devices' credentials are up)
            log.info(PROGRESS + "epoch %d/%d done (%.0f s)", epoch, epochs, time.monotonic() - began)
        perm = torch.from_numpy(rng.permutation(n)).to(device)
        for i in range(0, n, bs):
            idx = perm[i : i + bs]
            if idx.numel() < 2:  # batch norm needs two samples
                continue
            loss = F.cross_entropy(model(xt[idx]), yt[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    model.eval()
    log.info(PROGRESS + "epoch %d/%d done (%.0f s)", epochs, epochs, time.monotonic() - began)
    return model_params.full_vector(model.cpu())


def cache_key(cfg: FederationConfig, x: np.ndarray, y: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> str:
    """What determines the trained backbone: the recipe's config values, the model's layout (a user's factory may
    change under its name), the public set's bytes, the norm."""
    h = hashlib.sha256()
    h.update(repr(model_params.full_layout(backbone_model(cfg))).encode())
    recipe = (
        cfg.archs[0], cfg.in_shape, cfg.num_classes, cfg.proto_dim, cfg.adapter_rank, cfg.seed, cfg.lr,
        cfg.momentum, cfg.weight_decay, cfg.batch_size, cfg.backbone_epochs, tuple(mean), tuple(std),
        torch.__version__,
    )  # fmt: skip
    h.update(repr(recipe).encode())
    h.update(np.ascontiguousarray(x).tobytes())
    h.update(np.ascontiguousarray(y, np.int64).tobytes())
    return h.hexdigest()[:32]


def _cache_dir() -> Path | None:
    where = os.environ.get("PROTOFL_CACHE")
    if where == "":
        return None
    base = Path(where) if where else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "protofl"
    return base / "backbones"


def trained_backbone(
    cfg: FederationConfig,
    x: np.ndarray,
    y: np.ndarray,
    mean: Sequence[float],
    std: Sequence[float],
    *,
    device: str = "cpu",
) -> np.ndarray:
    """`train_backbone`, from the user's cache where this exact recipe and public set were trained before
    (~/.cache/protofl/backbones, or $PROTOFL_CACHE; PROTOFL_CACHE= turns it off). The cache holds what this
    machine computed: a float32 vector per key, written atomically."""
    where = _cache_dir()
    key = cache_key(cfg, x, y, mean, std)
    path = None if where is None else where / f"{key}.npy"
    if path is not None and path.is_file():
        try:
            vec = np.load(path, allow_pickle=False)
            if vec.dtype == np.float32 and vec.ndim == 1 and np.isfinite(vec).all():
                log.info(PROGRESS + "trained before, taken from this machine's cache (%s)", path)
                return vec
        except (OSError, ValueError):
            pass  # a broken cache file: train again, and replace it
    log.info(
        "training the shared backbone (%s, %d public images, %d epochs)", cfg.archs[0], len(y), cfg.backbone_epochs
    )
    vec = train_backbone(cfg, x, y, mean, std, device=device)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            with open(tmp, "wb") as f:
                np.save(f, vec, allow_pickle=False)
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("could not cache the shared backbone in %s: %s", path.parent, exc)
    return vec


def with_backbone(cfg: FederationConfig, train: Dataset, public: PublicSet | None) -> PublicSet | None:
    """The federation's public message with its shared backbone, where its plan ships one: trained on the public
    set's samples of `train` (`trained_backbone`); without public samples, or with backbone_epochs = 0, none
    travels and every device builds the seeded initial model instead (random features)."""
    if not RoundPlan.from_config(cfg).shared_backbone:
        return public
    idx = public_indices(train, cfg)
    if len(idx) == 0 or int(cfg.backbone_epochs) == 0:
        return public
    vec = trained_backbone(cfg, train.x[idx], train.y[idx], train.mean, train.std)
    return with_shared_backbone(public, train, vec)


class _Features(torch.nn.Module):
    def __init__(self, model: ProtoNet) -> None:
        super().__init__()
        self.m = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.m.features(x)


def backbone_graph(cfg: FederationConfig) -> tuple[bytes, list[tuple[str, tuple[int, ...]]]]:
    """The shared backbone's forward pass x -> h (the features the ridge statistics are of) as an ONNX graph without
    weights, for lite devices (edge_agent/inference/lite_backbone.py), and the layout of the backbone's vector
    [(name, shape)] whose names the graph's weight inputs carry. The weights are graph inputs (never constants), so
    a device feeds them from the vector it holds, whatever vector that is. TorchScript exporter, no constant folding,
    eval mode: every weight keeps its parameter's name. Needs the `onnx` extra (the package `onnx`)."""
    import io

    import onnx

    model = backbone_model(cfg)
    layout = [(name, tuple(int(d) for d in shape)) for name, shape in model_params.full_layout(model)]
    buf = io.BytesIO()
    with torch.no_grad():
        torch.onnx.export(
            _Features(model).eval(),
            (torch.zeros((2, *cfg.in_shape)),),
            buf,  # type: ignore[arg-type]  # (the TorchScript exporter writes to a file object too)
            dynamo=False,
            input_names=["x"],
            output_names=["h"],
            dynamic_axes={"x": {0: "n"}, "h": {0: "n"}},
            do_constant_folding=False,
            keep_initializers_as_inputs=True,
            training=torch.onnx.TrainingMode.EVAL,
            opset_version=17,
        )
    proto = onnx.load_from_string(buf.getvalue())
    names = {n for n, _ in layout}
    rename = {}
    for init in proto.graph.initializer:
        plain = init.name.removeprefix("m.")
        if plain not in names:
            raise ValueError(f"the backbone graph has a constant '{init.name}' that is no parameter of the model")
        rename[init.name] = plain
    del proto.graph.initializer[:]  # the weights: graph inputs, fed from the vector
    for value in proto.graph.input:
        value.name = rename.get(value.name, value.name)
    for node in proto.graph.node:
        for i, name in enumerate(node.input):
            if name in rename:
                node.input[i] = rename[name]
    onnx.checker.check_model(proto)
    return proto.SerializeToString(), layout


def _save(path: str, array: np.ndarray) -> None:
    tmp = Path(path + ".tmp")
    with open(tmp, "wb") as f:
        np.save(f, array, allow_pickle=False)
    os.replace(tmp, path)


def main(argv: Sequence[str] | None = None) -> int:
    """What `protofl-server start` runs in a child process, so that the server stays torch-free: train the shared
    backbone on the public set (--public NPZ with x, y, mean, std; --out NPY), and/or embed the server's labelled
    validation data with it (--embed NPZ with x, mean, std; --embed-out NPY; --backbone NPY: the backbone to embed
    with, else the trained one, else the seeded initial model). CONFIG: the config as `to_dict` JSON."""
    import json

    p = argparse.ArgumentParser(prog="python -m edge_agent.training.backbone", description=main.__doc__)
    p.add_argument("config")
    p.add_argument("--public")
    p.add_argument("--out")
    p.add_argument("--backbone")
    p.add_argument("--embed")
    p.add_argument("--embed-out")
    p.add_argument("--graph-out", help="also write the backbone's ONNX graph for lite devices here (+ .json: layout)")
    a = p.parse_args(argv)
    cfg = FederationConfig.from_dict(json.loads(Path(a.config).read_text()))
    vec = None
    if a.public:
        with np.load(a.public, allow_pickle=False) as z:
            x, y, mean, std = z["x"], z["y"], z["mean"].tolist(), z["std"].tolist()
        vec = trained_backbone(cfg, x, y, mean, std)
        _save(a.out, vec)
    elif a.backbone:
        vec = np.load(a.backbone, allow_pickle=False)
    if a.graph_out:
        import json as _json

        try:
            graph, layout = backbone_graph(cfg)
        except Exception as exc:  # noqa: BLE001 -- no graph: lite devices are refused, with this reason
            print(f"no ONNX graph of the backbone for lite devices: {type(exc).__name__}: {exc}", file=sys.stderr)
        else:
            Path(a.graph_out + ".json").write_text(_json.dumps([[n, list(sh)] for n, sh in layout]))
            Path(a.graph_out).write_bytes(graph)
    if a.embed:
        with np.load(a.embed, allow_pickle=False) as z:
            x, mean, std = z["x"], z["mean"].tolist(), z["std"].tolist()
        _save(a.embed_out, trainer.embed(backbone_model(cfg, vec), torch.from_numpy(normalize(x, mean, std))))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(main())
