"""The client model zoo: backbones and the prototype-space client model (docs/algorithms.md, "Notation").

Every client runs

    x -> backbone B_k -> h -> stem S_k -> adapter A_f -> z (R^m) -> [projection g_k] -> head H -> logits

* ``backbone`` is private and may differ per device (heterogeneous federations).
* ``stem`` is a private ``Linear(dim(h) -> m)`` that exists only where ``dim(h) != m``; otherwise it is
  ``nn.Identity`` so that no useless square matrix is trained (or exported) per device.
* ``adapter`` (A_f, a residual rank-r bottleneck) and ``head`` (H) form the *federated adapter*
  theta_a that presets may share (see ``edge_agent/training/params.py`` for its flattening order).
* ``projection`` is a private consensus projection g_k, present only when a technique asks for it.

The backbones are written out here (no torchvision dependency): the FedAvg CNN of McMahan et al.,
a two-layer MLP, CIFAR-style ResNet-8 / ResNet-18 and a narrow CIFAR-style MobileNetV2. When
torchvision is importable, ``tv_resnet18`` and ``tv_mobilenet_v3_small`` are offered as well, adapted to
small inputs; nothing requires them.

An architecture string (``--arch``, the config's ``archs``) is resolved in one place, :func:`resolve_arch`:
a built-in name, ``package.module:factory``, or a name an installed package registers in the entry-point
group ``protofl.models`` (name = "package.module:factory"). An own factory takes the input shape
``(c, h, w)`` and returns an ``nn.Module`` mapping ``(n, c, h, w)`` to features (flattened to ``(n, d)``);
``d`` is measured by one dry forward pass, and stem, adapter, head and projection wrap it as they wrap
the built-ins.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import math
from collections.abc import Callable, Iterator
from importlib.metadata import entry_points
from typing import Any

import numpy as np
import torch
from torch import nn

from protofl.errors import ConfigError

log = logging.getLogger("protofl.models")

# (architecture, input shape, output shape) of own backbones whose flattened feature width was logged: said once.
_FLATTENED: set[tuple[str, tuple[int, ...], tuple[int, ...]]] = set()

__all__ = [
    "ARCHITECTURES",
    "BUILTIN_ARCHITECTURES",
    "ConsensusProjection",
    "FedAvgCNN",
    "MLP",
    "MODEL_GROUP",
    "MobileNetV2",
    "OwnBackbone",
    "ProtoNet",
    "ResNet",
    "ResidualAdapter",
    "available_architectures",
    "build_backbone",
    "build_model",
    "eval_mode",
    "head_probabilities",
    "resolve_arch",
    "softmax_rows",
]

InShape = tuple[int, int, int]


# ---------------------------------------------------------------------------------------------------
# Backbones. Each maps (B, c, h, w) -> (B, out_dim) and exposes ``out_dim``.
# ---------------------------------------------------------------------------------------------------


class FedAvgCNN(nn.Module):
    """The CNN of McMahan et al. (2017): two 5x5 conv + max-pool stages, then a 512-unit dense layer."""

    def __init__(self, in_shape: InShape) -> None:
        super().__init__()
        c, h, w = in_shape
        if h < 4 or w < 4:
            raise ConfigError(f"architecture 'cnn' needs images of at least 4x4 pixels, got {h}x{w}")
        self.features = nn.Sequential(
            nn.Conv2d(c, 32, kernel_size=5, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, kernel_size=5, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )
        # The 5x5 convolutions with padding 2 keep the size and each max-pool floors it by 2, so the
        # flattened size is known from in_shape. Computing it here (instead of nn.LazyLinear) keeps the
        # parameter count and the seeded initialisation fixed at construction, which the adapter layout,
        # FedAvg vectors and ONNX export all rely on.
        flat = 64 * (h // 4) * (w // 4)
        self.fc = nn.Sequential(nn.Flatten(), nn.Linear(flat, 512), nn.ReLU(inplace=True))
        self.out_dim = 512

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))


class MLP(nn.Module):
    """Flatten, then two 512-unit ReLU layers: the cheapest backbone (no convolution at all)."""

    def __init__(self, in_shape: InShape, hidden: int = 512) -> None:
        super().__init__()
        flat = math.prod(in_shape)
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(flat, hidden),
            nn.ReLU(inplace=True),
            nn.Linear(hidden, hidden),
            nn.ReLU(inplace=True),
        )
        self.out_dim = hidden

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class BasicBlock(nn.Module):
    """ResNet basic block (two 3x3 convs) with a 1x1 projection shortcut when the shape changes."""

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        if stride != 1 or in_planes != planes:
            self.shortcut: nn.Module = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes)
            )
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """CIFAR-style ResNet: 3x3 stride-1 stem, no max-pool (small images), stages, global average pool.

    ``widths``/``blocks``/``strides`` describe the stages: ResNet-18 is (64,128,256,512) x (2,2,2,2) with
    strides (1,2,2,2); ResNet-8 is (16,32,64) x (1,1,1) with strides (1,2,2).
    """

    def __init__(
        self,
        in_shape: InShape,
        stem_width: int,
        widths: tuple[int, ...],
        blocks: tuple[int, ...],
        strides: tuple[int, ...],
    ) -> None:
        super().__init__()
        c = in_shape[0]
        self.stem = nn.Sequential(
            nn.Conv2d(c, stem_width, 3, stride=1, padding=1, bias=False),
            nn.BatchNorm2d(stem_width),
            nn.ReLU(inplace=True),
        )
        layers: list[nn.Module] = []
        in_planes = stem_width
        for width, n_blocks, stride in zip(widths, blocks, strides, strict=True):
            for i in range(n_blocks):
                layers.append(BasicBlock(in_planes, width, stride if i == 0 else 1))
                in_planes = width
        self.layers = nn.Sequential(*layers)
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.out_dim = in_planes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.layers(self.stem(x)))


def _make_divisible(v: float, divisor: int = 8) -> int:
    """Round a scaled channel count to a multiple of ``divisor`` (the MobileNet convention)."""
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:  # never round down by more than 10%
        new_v += divisor
    return new_v


class InvertedResidual(nn.Module):
    """MobileNetV2 block: 1x1 expand, 3x3 depthwise, 1x1 linear projection; residual when shapes match."""

    def __init__(self, inp: int, oup: int, stride: int, expand_ratio: int) -> None:
        super().__init__()
        hidden = inp * expand_ratio
        self.use_residual = stride == 1 and inp == oup
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers += [nn.Conv2d(inp, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6(inplace=True)]
        layers += [
            nn.Conv2d(hidden, hidden, 3, stride=stride, padding=1, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden),
            nn.ReLU6(inplace=True),
            # No activation after the projection: the "linear bottleneck" of the paper.
            nn.Conv2d(hidden, oup, 1, bias=False),
            nn.BatchNorm2d(oup),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv(x)
        return x + out if self.use_residual else out


class MobileNetV2(nn.Module):
    """Narrow CIFAR-style MobileNetV2 (Sandler et al. 2018) for small images.

    Width multiplier 0.5. For 28/32-pixel inputs the stem has stride 1 and the second stage stride 1 as
    well (the usual CIFAR adaptation; the ImageNet strides would shrink a 32x32 image to 1x1), so the
    total down-sampling is 8x. The final 1x1 conv goes to 256 channels (not 1280) to keep h small.
    """

    # (expansion t, output channels c, repeats n, first stride s) -- the paper's table, CIFAR strides.
    CONFIG: tuple[tuple[int, int, int, int], ...] = (
        (1, 16, 1, 1),
        (6, 24, 2, 1),
        (6, 32, 3, 2),
        (6, 64, 4, 2),
        (6, 96, 3, 1),
        (6, 160, 3, 2),
        (6, 320, 1, 1),
    )

    def __init__(self, in_shape: InShape, width_mult: float = 0.5, last_channels: int = 256) -> None:
        super().__init__()
        c = in_shape[0]
        stem = _make_divisible(32 * width_mult)
        layers: list[nn.Module] = [
            nn.Conv2d(c, stem, 3, stride=1, padding=1, bias=False),
            nn.BatchNorm2d(stem),
            nn.ReLU6(inplace=True),
        ]
        inp = stem
        for t, ch, n, s in self.CONFIG:
            oup = _make_divisible(ch * width_mult)
            for i in range(n):
                layers.append(InvertedResidual(inp, oup, s if i == 0 else 1, t))
                inp = oup
        layers += [
            nn.Conv2d(inp, last_channels, 1, bias=False),
            nn.BatchNorm2d(last_channels),
            nn.ReLU6(inplace=True),
        ]
        self.features = nn.Sequential(*layers)
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.out_dim = last_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.features(x))


class OwnBackbone(nn.Module):
    """A backbone built outside the zoo (an own factory, or torchvision): ``net``'s output flattened to (n, d)."""

    def __init__(self, net: nn.Module, out_dim: int) -> None:
        super().__init__()
        self.net = net
        self.out_dim = out_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.net(x), 1)


def _torchvision() -> Any:
    # A torchvision wheel built for another torch can fail at import with RuntimeError (missing operators), not only
    # ImportError: either way the architecture cannot be built here.
    try:
        import torchvision

        return torchvision
    except Exception as exc:  # noqa: BLE001
        raise ConfigError(f"the torchvision architectures need a torchvision that imports here: {exc}") from exc


def _tv_resnet18(in_shape: InShape) -> nn.Module:
    torchvision = _torchvision()

    net = torchvision.models.resnet18(weights=None)
    # Small images: 3x3 stride-1 stem and no max-pool (as in our own ResNet18); any channel count.
    net.conv1 = nn.Conv2d(in_shape[0], 64, 3, stride=1, padding=1, bias=False)
    net.maxpool = nn.Identity()
    net.fc = nn.Identity()
    return OwnBackbone(net, 512)


def _tv_mobilenet_v3_small(in_shape: InShape) -> nn.Module:
    torchvision = _torchvision()

    net = torchvision.models.mobilenet_v3_small(weights=None)
    first = net.features[0][0]
    net.features[0][0] = nn.Conv2d(in_shape[0], first.out_channels, 3, stride=1, padding=1, bias=False)
    net.classifier = nn.Identity()  # the pooled 576-channel features are h
    return OwnBackbone(net, 576)


def _torchvision_available() -> bool:
    # Found, not imported: importing torchvision costs a device process memory and time on every `join`, and only
    # its two architectures need it (they import it when built, and say so if that import fails).
    return importlib.util.find_spec("torchvision") is not None


_BUILDERS: dict[str, Callable[[InShape], nn.Module]] = {
    "cnn": FedAvgCNN,
    "mlp": MLP,
    "resnet8": lambda s: ResNet(s, 16, (16, 32, 64), (1, 1, 1), (1, 2, 2)),
    "resnet18": lambda s: ResNet(s, 64, (64, 128, 256, 512), (2, 2, 2, 2), (1, 2, 2, 2)),
    "mobilenetv2": MobileNetV2,
}
BUILTIN_ARCHITECTURES: tuple[str, ...] = ("cnn", "mlp", "resnet8", "resnet18", "mobilenetv2")

if _torchvision_available():
    _BUILDERS["tv_resnet18"] = _tv_resnet18
    _BUILDERS["tv_mobilenet_v3_small"] = _tv_mobilenet_v3_small
    ARCHITECTURES: tuple[str, ...] = BUILTIN_ARCHITECTURES + ("tv_resnet18", "tv_mobilenet_v3_small")
else:
    ARCHITECTURES = BUILTIN_ARCHITECTURES


MODEL_GROUP = "protofl.models"
FACTORY_CONTRACT = (
    "a factory takes the input shape (channels, height, width) and returns a torch.nn.Module "
    "mapping (n, c, h, w) to (n, d) features"
)


def _installed_models() -> dict[str, str]:
    """Names registered in the ``protofl.models`` entry-point group -> their "module:factory" value."""
    return {ep.name: ep.value for ep in entry_points(group=MODEL_GROUP) if ep.name not in _BUILDERS}


def available_architectures() -> list[str]:
    """Names accepted by :func:`build_model` here: the built-ins (torchvision ones only if importable), then
    the installed ``protofl.models`` names. Any ``package.module:factory`` is accepted as well."""
    return list(ARCHITECTURES) + sorted(_installed_models())


def _accepted() -> str:
    installed = ", ".join(sorted(_installed_models())) or "none installed"
    return (
        f"known: {', '.join(ARCHITECTURES)}; or package.module:factory ({FACTORY_CONTRACT}); or a name an "
        f"installed package registers in the entry-point group {MODEL_GROUP} ({installed})"
    )


@contextlib.contextmanager
def eval_mode(module: nn.Module) -> Iterator[None]:
    """Eval mode inside the block, then every submodule's own training flag restored.

    Not ``module.train(was_training)``: that would flip a frozen backbone's BatchNorm back into training
    mode (the legacy ONNX exporter does exactly that to a wrapper's children, so export restores too).
    """
    flags = {m: m.training for m in module.modules()}
    module.eval()
    try:
        yield
    finally:
        for m, flag in flags.items():
            m.training = flag


def _own_backbone(arch: str, factory: Callable[[InShape], object], shape: InShape) -> OwnBackbone:
    """Call an own factory and measure its feature width d with one dry forward pass (eval mode, no grad,
    RNG untouched, so seeded construction is as reproducible as for a built-in)."""
    try:
        net = factory(shape)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 -- third-party code: report whatever it raised
        raise ConfigError(
            f"architecture {arch!r}: the factory failed for input shape {shape}: "
            f"{type(exc).__name__}: {exc}; {FACTORY_CONTRACT}"
        ) from exc
    if not isinstance(net, nn.Module):
        raise ConfigError(
            f"architecture {arch!r}: the factory returned {type(net).__name__}, not a torch.nn.Module; {_accepted()}"
        )
    try:
        with eval_mode(net), torch.no_grad(), torch.random.fork_rng(devices=[]):
            out = net(torch.zeros((2, *shape)))
    except Exception as exc:  # noqa: BLE001
        raise ConfigError(
            f"architecture {arch!r}: a forward pass on a (2, {', '.join(map(str, shape))}) batch "
            f"failed: {type(exc).__name__}: {exc}; {FACTORY_CONTRACT}"
        ) from exc
    if not isinstance(out, torch.Tensor) or out.dim() < 2 or out.shape[0] != 2 or out[0].numel() < 1:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(
            f"architecture {arch!r}: the backbone maps a (2, {', '.join(map(str, shape))}) batch to "
            f"{got}, expected a tensor (2, d) (or (2, ...), flattened); {_accepted()}"
        )
    width = int(out[0].numel())
    said = (arch, tuple(shape), tuple(out.shape[1:]))
    if out.dim() > 2 and said not in _FLATTENED:
        _FLATTENED.add(said)
        log.info(
            "architecture %r: the backbone's output per sample, %s, is flattened to %d features (the feature width)",
            arch,
            "x".join(map(str, out.shape[1:])),
            width,
        )
    return OwnBackbone(net, width)


def _load_factory(arch: str, target: str) -> object:
    """Import "package.module:factory" (the factory may be a dotted attribute path)."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"architecture {arch!r}: expected package.module:factory; {_accepted()}")
    if module_name.endswith(".py"):
        raise ConfigError(
            f"architecture {arch!r}: name the module, not the file: "
            f"{module_name[:-3].replace('/', '.')}:{attr} with its folder on PYTHONPATH"
        )
    try:
        obj: object = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except Exception as exc:  # noqa: BLE001 -- an import runs third-party code
        raise ConfigError(
            f"architecture {arch!r}: cannot load {target} ({type(exc).__name__}: {exc}); {_accepted()}"
        ) from exc
    if not callable(obj):
        raise ConfigError(f"architecture {arch!r}: {target} is a {type(obj).__name__}, not callable; {_accepted()}")
    return obj


def resolve_arch(arch: str) -> Callable[[InShape], nn.Module]:
    """The backbone factory an architecture string names (see the module docstring); ConfigError if none.

    The factory returned maps an input shape to a backbone exposing ``out_dim``.
    """
    if not isinstance(arch, str) or not arch:
        raise ConfigError(f"an architecture must be a non-empty string, got {arch!r}; {_accepted()}")
    if arch in _BUILDERS:
        return _BUILDERS[arch]
    target = arch if ":" in arch else _installed_models().get(arch)
    if target is None:
        raise ConfigError(f"unknown architecture {arch!r}; {_accepted()}")
    factory = _load_factory(arch, target)
    return lambda shape: _own_backbone(arch, factory, shape)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------
# The prototype-space client model.
# ---------------------------------------------------------------------------------------------------


class ResidualAdapter(nn.Module):
    """A_f(h) = h + W_up relu(W_down h): a residual rank-r bottleneck (the federated feature adapter)."""

    def __init__(self, dim: int, rank: int = 32) -> None:
        super().__init__()
        self.down = nn.Linear(dim, rank)
        self.up = nn.Linear(rank, dim)
        # W_up (and its bias) start at zero, so A_f starts as the identity: z = stem(h) exactly, and the
        # first rounds neither distort the backbone's features nor make the prototypes of clients with
        # different random adapters disagree for a reason unrelated to the data. W_up still receives
        # gradient at step 0 (relu(W_down h) is non-zero), and W_down does as soon as W_up moves -- the
        # LoRA initialisation.
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)
        self.dim = dim
        self.rank = rank

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.up(torch.relu(self.down(h)))


class ConsensusProjection(nn.Sequential):
    """A private consensus projection g_k (docs/algorithms.md).

    Linear(m,2m), LayerNorm, ReLU, Dropout(0.1), Linear(2m,m), LayerNorm.
    """

    def __init__(self, dim: int, dropout: float = 0.1) -> None:
        super().__init__(
            nn.Linear(dim, 2 * dim),
            nn.LayerNorm(2 * dim),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(2 * dim, dim),
            nn.LayerNorm(dim),
        )


class ProtoNet(nn.Module):
    """Client model: backbone -> stem -> adapter -> [projection] -> head (docs/algorithms.md, client model)."""

    def __init__(
        self,
        backbone: nn.Module,
        num_classes: int,
        proto_dim: int = 512,
        adapter_rank: int = 32,
        projection: bool = False,
        arch: str = "custom",
        in_shape: InShape = (1, 28, 28),
    ) -> None:
        super().__init__()
        # getattr: nn.Module.__getattr__ types any attribute as Tensor | Module; out_dim is the plain int every
        # backbone sets (built-in or installed).
        h_dim = int(getattr(backbone, "out_dim"))  # noqa: B009
        self.backbone = backbone
        self.stem: nn.Module = nn.Identity() if h_dim == proto_dim else nn.Linear(h_dim, proto_dim)
        self.adapter = ResidualAdapter(proto_dim, adapter_rank)
        self.projection: nn.Module | None = ConsensusProjection(proto_dim) if projection else None
        self.head = nn.Linear(proto_dim, num_classes)
        self._arch = arch
        self._in_shape = tuple(int(v) for v in in_shape)
        self._proto_dim = proto_dim
        self._num_classes = num_classes
        self.backbone_dim = h_dim

    @property
    def proto_dim(self) -> int:
        return self._proto_dim

    @property
    def num_classes(self) -> int:
        return self._num_classes

    @property
    def arch(self) -> str:
        return self._arch

    @property
    def in_shape(self) -> InShape:
        return self._in_shape  # type: ignore[return-value]

    def backbone_features(self, x: torch.Tensor) -> torch.Tensor:
        """h = B(x). Split out so a frozen-backbone client can compute h once and cache it."""
        return self.backbone(x)

    def features_from_backbone(self, h: torch.Tensor) -> torch.Tensor:
        """z from cached h: stem, adapter and (if present) the consensus projection."""
        z = self.adapter(self.stem(h))
        if self.projection is not None:
            z = self.projection(z)
        return z

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The prototype-space embedding z (not normalised; unit-prototype losses normalise it)."""
        return self.features_from_backbone(self.backbone_features(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def softmax_rows(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax of (n, C) logits, float32 (numpy: how a device turns scores into probabilities)."""
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)).astype(np.float32, copy=False)


def head_probabilities(model: ProtoNet, z: np.ndarray) -> np.ndarray:
    """(n, C) class probabilities from features z: the head's softmax.

    The head is a single Linear: applied in numpy it always uses the head's current weights (a technique
    may anchor them at round start), needs no export, and lets evaluation reuse one forward pass for
    the head's and the nearest prototype's predictions.
    """
    if len(z) == 0:
        return np.zeros((0, model.num_classes), dtype=np.float32)
    w = model.head.weight.detach().cpu().numpy()
    b = model.head.bias.detach().cpu().numpy()
    return softmax_rows(z @ w.T + b)


def _check_in_shape(in_shape: tuple[int, ...]) -> InShape:
    try:
        shape = tuple(int(v) for v in in_shape)
    except (TypeError, ValueError):
        raise ConfigError(f"in_shape must be (channels, height, width), got {in_shape!r}") from None
    if len(shape) != 3 or min(shape) < 1:
        raise ConfigError(f"in_shape must be three positive ints (channels, height, width), got {in_shape!r}")
    return shape[0], shape[1], shape[2]


def build_backbone(arch: str, in_shape: tuple[int, int, int]) -> nn.Module:
    """Just the backbone B (uses the global torch RNG; :func:`build_model` seeds it)."""
    return resolve_arch(arch)(_check_in_shape(in_shape))


def build_model(
    arch: str,
    in_shape: tuple[int, int, int],
    num_classes: int,
    proto_dim: int = 512,
    adapter_rank: int = 32,
    projection: bool = False,
    seed: int | None = None,
) -> ProtoNet:
    """Build a :class:`ProtoNet`. With ``seed`` the weights are bit-identical across calls and processes.

    The seeded construction runs inside ``torch.random.fork_rng`` so it neither depends on nor disturbs
    the caller's global RNG state (a simulator building 20 clients must not shift its own data order).
    """
    factory = resolve_arch(arch)
    shape = _check_in_shape(in_shape)
    if num_classes < 1:
        raise ConfigError(f"num_classes must be >= 1, got {num_classes}")
    if proto_dim < 1 or adapter_rank < 1:
        raise ConfigError(f"proto_dim and adapter_rank must be >= 1, got {proto_dim}, {adapter_rank}")

    def make() -> ProtoNet:
        return ProtoNet(factory(shape), num_classes, proto_dim, adapter_rank, projection, arch, shape)

    if seed is None:
        return make()
    # devices=[]: CPU generator only; avoids touching (or warning about) CUDA state on GPU hosts.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        return make()
