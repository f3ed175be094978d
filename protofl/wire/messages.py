"""Typed messages of wire protocol v1, one frozen dataclass per envelope kind.

Constructors validate and normalise (arrays to float32 / int64, tuples to lists) and raise `WireError`
(a ValueError) on a bad field, so one set of checks guards both the sender and the receiver:
`from_body` only unpacks the wire structure and lets the constructor judge the values.
Every body key is always present on the wire (absent values are nil): unknown or missing keys are
errors. Bools are never ints. Float fields accept msgpack ints (some encoders write 2.0 as 2), never
bools, and must be finite. Wire keys are the field names, except inside `ProtoSet` ("c", "v", "n").
"""

from __future__ import annotations

import calendar
import math
import re
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from protofl import WIRE_VERSION
from protofl.errors import WireError
from protofl.names import MAX_LABEL, MAX_TEXT, printable
from protofl.sparse import SparseVector
from protofl.traits import Traits
from protofl.wire.codec import (
    DEFAULT_LIMITS,
    FLOAT_DTS,
    KINDS,
    MAX_NDIM,
    MAX_NEIGHBOURS,
    MAX_SPARSE_N,
    Envelope,
    Limits,
    check_sparse,
    decode_array,
    decode_sparse,
    encode_array,
    encode_sparse,
    expect_bool,
    expect_float,
    expect_int,
    expect_keys,
    expect_name,
    expect_str,
    pack_envelope,
    unpack_envelope,
)

if TYPE_CHECKING:
    from typing_extensions import Self

MAX_CLASS = 2**16 - 1  # class ids travel as u2
MAX_COUNT = 2**32 - 1  # sample counts travel as u4
MAX_PARAM_DEPTH = 4  # the params map itself is level 1
MAX_MAP_KEYS = 256  # entries of a map of named figures a device sends (Metrics.extra)


class _Body:
    """Field-wise equality comparing arrays by value (the generated one would call bool() on arrays)."""

    __hash__ = None  # type: ignore[assignment]

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(_same(getattr(self, f.name), getattr(other, f.name)) for f in fields(self))  # type: ignore[arg-type]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, SparseVector) or isinstance(b, SparseVector):
        return (
            isinstance(a, SparseVector)
            and isinstance(b, SparseVector)
            and a.n == b.n
            and _same(a.indices, b.indices)
            and _same(a.values, b.values)
        )
    return bool(a == b)


def _set(obj: object, **values: Any) -> None:
    for k, v in values.items():
        object.__setattr__(obj, k, v)


def _build(cls: Callable[..., Any], what: str, **kw: Any) -> Any:
    try:
        return cls(**kw)
    except WireError as e:
        raise WireError(f"{what}: {e}") from None


def _floats(a: Any, what: str, ndim: int) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype == np.bool_ or not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)):
        raise WireError(f"{what}: expected a float array, got dtype {a.dtype}")
    if a.ndim != ndim:
        raise WireError(f"{what}: expected {ndim}-D, got shape {list(a.shape)}")
    with np.errstate(over="ignore", invalid="ignore"):
        x = a.astype(np.float32, copy=False)
    if not np.isfinite(x).all():
        raise WireError(f"{what}: non-finite values (NaN, inf, or beyond float32)")
    return x


def _ints(a: Any, what: str, lo: int, hi: int, increasing: bool = False) -> np.ndarray:
    a = np.asarray(a)
    if a.size and (a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.integer)):
        raise WireError(f"{what}: expected integers, got dtype {a.dtype}")
    if a.ndim != 1:
        raise WireError(f"{what}: expected 1-D, got shape {list(a.shape)}")
    if a.size and (int(a.min()) < lo or int(a.max()) > hi):
        raise WireError(f"{what}: values must lie in [{lo}, {hi}]")
    x = a.astype(np.int64)
    if increasing and (np.diff(x) <= 0).any():
        raise WireError(f"{what}: must be sorted ascending without duplicates")
    return x


def _opt(v: Any, decode: Any) -> Any:
    return None if v is None else decode(v)


# --- body components -----------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class ProtoSet(_Body):
    """Prototypes for some classes: row i of `values` (k, w) is class `classes[i]`, from `counts[i]` samples."""

    classes: np.ndarray
    values: np.ndarray
    counts: np.ndarray | None = None
    dt: str = "f4"  # wire dtype of `values`: f4, f2 or q8

    def __post_init__(self) -> None:
        classes = _ints(self.classes, "classes", 0, MAX_CLASS, increasing=True)
        values = _floats(self.values, "values", 2)
        counts = None if self.counts is None else _ints(self.counts, "counts", 1, MAX_COUNT)
        self._agree(classes, values, counts, self.dt)
        _set(self, classes=classes, values=values, counts=counts)

    @staticmethod
    def _agree(classes: np.ndarray, values: np.ndarray, counts: np.ndarray | None, dt: str) -> None:
        if dt not in FLOAT_DTS:
            raise WireError(f"dt {dt!r} is not a float wire dtype (f4, f2, q8)")
        if values.shape[0] != classes.size:
            raise WireError(f"{classes.size} classes but {values.shape[0]} prototype rows")
        if counts is not None and counts.size != classes.size:
            raise WireError(f"{classes.size} classes but {counts.size} counts")

    @classmethod
    def _decoded(cls, classes: np.ndarray, values: np.ndarray, counts: np.ndarray | None, dt: str) -> Self:
        """From the arrays `decode_array` built: classes u2 and counts u4 (1-D), values finite float32 (2-D).

        The decoder has checked dtypes, shapes and finiteness: only what it cannot know is checked here (class
        order, counts >= 1, agreeing lengths), with the constructor's messages, and no array is passed over
        a second time for what it was already checked for (one upload's decode, issue 27)."""
        if classes.size > 1 and not (classes[1:] > classes[:-1]).all():
            raise WireError("classes: must be sorted ascending without duplicates")
        if counts is not None and counts.size and counts.min() < 1:
            raise WireError(f"counts: values must lie in [1, {MAX_COUNT}]")
        cls._agree(classes, values, counts, dt)
        return cls._trusted(classes.astype(np.int64), values, None if counts is None else counts.astype(np.int64), dt)

    @classmethod
    def _trusted(cls, classes: np.ndarray, values: np.ndarray, counts: np.ndarray | None, dt: str) -> Self:
        """A set of arrays a decoder has checked whole (`_decoded`'s checks too): classes and counts int64."""
        out = cls.__new__(cls)
        out.__dict__.update(classes=classes, values=values, counts=counts, dt=dt)  # (one call: frozen fields)
        return out

    @classmethod
    def from_table(
        cls, table: Mapping[int, np.ndarray], width: int, dt: str = "f4", counts: Mapping[int, int] | None = None
    ) -> Self:
        """Rows in ascending class order; `width` shapes an empty table."""
        classes = sorted(table)
        values = (
            np.stack([table[c] for c in classes]).astype(np.float32)
            if classes
            else np.zeros((0, width), dtype=np.float32)
        )
        cnt = None if counts is None else np.asarray([counts[c] for c in classes], dtype=np.int64)
        return cls(classes=np.asarray(classes, dtype=np.int64), values=values, counts=cnt, dt=dt)

    def table(self) -> tuple[dict[int, np.ndarray], dict[int, int] | None]:
        """({class: values row}, {class: count} or None)."""
        rows = {int(c): self.values[i] for i, c in enumerate(self.classes)}
        counts = None if self.counts is None else {int(c): int(self.counts[i]) for i, c in enumerate(self.classes)}
        return rows, counts

    def to_body(self) -> dict:
        return {
            "c": encode_array(self.classes, "u2"),
            "v": encode_array(self.values, self.dt),
            "n": None if self.counts is None else encode_array(self.counts, "u4"),
        }

    @classmethod
    def from_body(cls, body: Any, limits: Limits = DEFAULT_LIMITS, what: str = "prototypes") -> Self:
        b = expect_keys(body, ("c", "v", "n"), what)
        values = decode_array(b["v"], what=f"{what} values", limits=limits, dts=FLOAT_DTS, ndim=2)
        classes = decode_array(b["c"], what=f"{what} classes", limits=limits, dts=("u2",), ndim=1)
        counts = (
            None if b["n"] is None else decode_array(b["n"], what=f"{what} counts", limits=limits, dts=("u4",), ndim=1)
        )
        return _build(cls._decoded, what, classes=classes, values=values, counts=counts, dt=b["v"]["dt"])


def _plain(v: Any, what: str, depth: int) -> Any:
    """A plain msgpack value (None/bool/int/float/str/list/dict) nested at most MAX_PARAM_DEPTH deep."""
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        if not -(2**63) <= v < 2**64:
            raise WireError(f"{what}: integer {v} does not fit msgpack")
        return int(v)
    if isinstance(v, float):
        return expect_float(v, what)
    if isinstance(v, (list, tuple, dict)):
        if depth > MAX_PARAM_DEPTH:
            raise WireError(f"{what}: nested deeper than {MAX_PARAM_DEPTH} levels")
        if isinstance(v, dict):
            for k in v:
                if not isinstance(k, str):
                    raise WireError(f"{what}: map key {k!r} is not a string")
            return {k: _plain(x, f"{what}.{k[:40]}", depth + 1) for k, x in v.items()}
        return [_plain(x, f"{what}[{i}]", depth + 1) for i, x in enumerate(v)]
    raise WireError(f"{what}: {type(v).__name__} is not a plain value (None/bool/int/float/str/list/dict)")


def _layout(v: Any) -> list[tuple[str, tuple[int, ...]]]:
    if not isinstance(v, (list, tuple)):
        raise WireError(f"adapter_layout: expected a list, got {type(v).__name__}")
    out: list[tuple[str, tuple[int, ...]]] = []
    seen: set[str] = set()  # repeated names by a set: a 50,000-entry layout must not cost 50,000**2 / 2 compares
    total = 0
    for i, entry in enumerate(v):
        name, dims = _layout_entry(i, entry)
        if not name or name in seen:
            raise WireError(f"adapter_layout[{i}]: name {name!r} is empty or repeated")
        seen.add(name)
        total += math.prod(dims)
        if total >= MAX_SPARSE_N:
            raise WireError("adapter_layout: the adapter has 2**32 or more parameters")
        out.append((name, dims))
    return out


def _layout_entry(i: int, entry: Any) -> tuple[str, tuple[int, ...]]:
    """One [name, [dims...]]; the messages naming entry i are only built for an entry that fails."""
    if not isinstance(entry, (list, tuple)) or len(entry) != 2 or not isinstance(entry[1], (list, tuple)):
        raise WireError(f"adapter_layout[{i}]: expected [name, [dims...]]")
    name, dims = entry
    if not isinstance(name, str) or len(name) > 256:
        expect_str(name, f"adapter_layout[{i}] name", 256)  # raises, naming what is wrong
    if len(dims) > MAX_NDIM:
        raise WireError(f"adapter_layout[{i}]: more than {MAX_NDIM} dimensions")
    if all(type(d) is int and 0 <= d < MAX_SPARSE_N for d in dims):  # plain ints, as msgpack gives them
        return name, tuple(dims)
    return name, tuple(expect_int(d, f"adapter_layout[{i}] dimension", 0, MAX_SPARSE_N - 1) for d in dims)


def _str_map(v: Any, what: str, value: Any) -> dict:
    if not isinstance(v, dict):
        raise WireError(f"{what}: expected a map, got {type(v).__name__}")
    if len(v) > MAX_MAP_KEYS:
        raise WireError(f"{what}: {len(v)} keys, over the limit of {MAX_MAP_KEYS}")
    for k in v:
        if not isinstance(k, str):
            raise WireError(f"{what}: map key {printable(repr(k), 40)} is not a string")
        expect_str(k, f"{what} key", MAX_LABEL)
    return {k: value(x, f"{what}.{k[:40]}") for k, x in v.items()}


def _decode_masks(packed: Any, shape: Any, limits: Limits) -> np.ndarray | None:
    if packed is None and shape is None:
        return None
    if packed is None or shape is None:
        raise WireError("config: class_masks and mask_shape must both be nil or both be set")
    if not isinstance(shape, list) or len(shape) != 2:
        raise WireError("config mask_shape: expected [classes, dims]")
    c, m = (expect_int(d, "config mask_shape", 0, limits.max_elements) for d in shape)
    if c * m > limits.max_elements:
        raise WireError(f"config mask_shape {[c, m]}: {c * m} bits, over the element limit {limits.max_elements}")
    bits = decode_array(packed, what="config class_masks", limits=limits, dts=("u1",), ndim=1)
    if bits.size != (c * m + 7) // 8:
        raise WireError(f"config class_masks: {bits.size} bytes, mask_shape {[c, m]} needs {(c * m + 7) // 8}")
    if (c * m) % 8 and bits[-1] >> ((c * m) % 8):
        raise WireError("config class_masks: bits set beyond mask_shape")
    return np.unpackbits(bits, count=c * m, bitorder="little").astype(bool).reshape(c, m)


# --- messages ------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Join(_Body):
    """A device announces itself; `token` is checked against the join allow-list when one is set."""

    KIND: ClassVar[str] = "join"
    arch: str
    n_samples: int
    profile: str = ""
    agent_version: str = ""
    token: str = ""
    # What the device says it is (protofl/traits.py): additive within version 1, the key travels only with traits.
    traits: Traits | None = None
    # Whether the device trains the model (torch) or only runs the shared backbone's forward passes (a lite device,
    # onnxruntime: protofl/lite.py). Additive within version 1: the key travels only when False.
    trains: bool = True

    def __post_init__(self) -> None:
        for name in ("arch", "profile", "agent_version", "token"):
            expect_str(getattr(self, name), name, MAX_TEXT if name == "token" else MAX_LABEL)
        _set(self, n_samples=expect_int(self.n_samples, "n_samples"))
        _check_traits(self.traits)
        if not isinstance(self.trains, bool):
            raise WireError(f"trains: expected a boolean, got {type(self.trains).__name__}")

    def to_body(self) -> dict:
        body = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("traits", "trains")}
        if self.traits is not None:
            body["traits"] = self.traits.to_body()
        if not self.trains:
            body["trains"] = False
        return body

    @classmethod
    def from_body(cls, body: Any, limits: Limits = DEFAULT_LIMITS) -> Self:
        keys = [f.name for f in fields(cls) if f.name not in ("traits", "trains")]
        if isinstance(body, dict) and "trains" in body:
            body = dict(body)
            trains = body.pop("trains")
            if trains is not False:
                raise WireError("join: trains travels only as false (a device that trains sends no key)")
            return _build(cls, cls.KIND, **_with_traits(body, keys, cls.KIND), trains=False)
        return _build(cls, cls.KIND, **_with_traits(body, keys, cls.KIND))


@dataclass(frozen=True, eq=False)
class Config(_Body):
    """The federation's retained configuration. Masks travel as little-endian packed bits of the flattened (C, m)."""

    KIND: ClassVar[str] = "config"
    preset: str
    params: dict[str, Any] = field(default_factory=dict)
    adapter_layout: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    class_masks: np.ndarray | None = None
    limits: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        expect_str(self.preset, "preset")
        if not isinstance(self.params, dict):
            raise WireError(f"params: expected a map, got {type(self.params).__name__}")
        masks = self.class_masks
        if masks is not None:
            masks = np.asarray(masks)
            if masks.dtype != np.bool_ or masks.ndim != 2:
                raise WireError(f"class_masks: expected a 2-D bool array, got {masks.dtype} {list(masks.shape)}")
        _set(
            self,
            params=_plain(self.params, "params", 1),
            adapter_layout=_layout(self.adapter_layout),
            class_masks=masks,
            limits=_str_map(self.limits, "limits", expect_int),
        )

    def to_body(self) -> dict:
        m = self.class_masks
        return {
            "preset": self.preset,
            "params": self.params,
            "adapter_layout": [[name, list(dims)] for name, dims in self.adapter_layout],
            "class_masks": None if m is None else encode_array(np.packbits(m.reshape(-1), bitorder="little"), "u1"),
            "mask_shape": None if m is None else list(m.shape),
            "limits": self.limits,
        }

    @classmethod
    def from_body(cls, body: Any, limits: Limits = DEFAULT_LIMITS) -> Self:
        keys = ("preset", "params", "adapter_layout", "class_masks", "mask_shape", "limits")
        b = expect_keys(body, keys, cls.KIND)
        masks = _decode_masks(b["class_masks"], b["mask_shape"], limits)
        return _build(
            cls, cls.KIND, preset=b["preset"], params=b["params"], adapter_layout=b["adapter_layout"],
            class_masks=masks, limits=b["limits"],
        )  # fmt: skip


@dataclass(frozen=True, eq=False)
class PublicSet(_Body):
    """The server-held public samples: x (n, c, h, w) uint8 or float32, labels y drawn from `classes`; and
    `backbone`, where the federation has a shared one (the ridge predictor's, protofl/algorithms/ridge.py): the
    whole parameter vector of its first architecture's model, float32, as edge_agent.training.params flattens it, and
    `norm`,
    the per-channel (mean, std) its inputs were normalised with (images in [0, 1]): a device embeds its data so."""

    KIND: ClassVar[str] = "public"
    x: np.ndarray
    y: np.ndarray
    classes: list[int]
    backbone: np.ndarray | None = None
    norm: tuple[list[float], list[float]] | None = None
    # The backbone's forward pass as an ONNX graph for lite devices (onnxruntime, no torch: protofl/lite.py): the
    # graph without weights, its weights graph inputs named as `layout` names them; `layout` is the backbone
    # vector's [(name, shape)] in order, so a device feeds the graph slices of the vector (and of any later one).
    # Additive within version 1: the key "lite" travels only with a graph, and a graph only with a backbone.
    graph: bytes | None = None
    layout: list[tuple[str, tuple[int, ...]]] | None = None

    def __post_init__(self) -> None:
        _check_graph(self.graph, self.layout, self.backbone)
        x = np.asarray(self.x)
        if x.dtype != np.uint8:
            x = _floats(x, "x", 4)
        elif x.ndim != 4:
            raise WireError(f"x: expected (n, c, h, w), got shape {list(x.shape)}")
        y = _ints(self.y, "y", 0, MAX_CLASS)
        if not isinstance(self.classes, (list, tuple)):
            raise WireError(f"classes: expected a list, got {type(self.classes).__name__}")
        classes = [expect_int(c, "classes", 0, MAX_CLASS) for c in self.classes]
        if any(a >= b for a, b in zip(classes, classes[1:], strict=False)):
            raise WireError("classes: must be sorted ascending without duplicates")
        if x.shape[0] != y.size:
            raise WireError(f"{x.shape[0]} samples but {y.size} labels")
        if not np.isin(y, classes).all():
            raise WireError("y: a label is not in classes")
        norm = self.norm
        if norm is not None:
            if self.backbone is None:
                raise WireError("norm: only with a backbone")
            if not isinstance(norm, (tuple, list)) or len(norm) != 2:
                raise WireError("norm: expected (mean, std)")
            mean, std = (_floats(v, f"norm {w}", 1).tolist() for v, w in zip(norm, ("mean", "std"), strict=True))
            if len(mean) != len(std) or not 1 <= len(mean) <= 16 or min(std) <= 0:
                raise WireError("norm: mean and std need one value per channel (at most 16), std > 0")
            norm = (mean, std)
        backbone = _opt(self.backbone, lambda a: _floats(a, "backbone", 1))
        _set(self, x=x, y=y, classes=classes, backbone=backbone, norm=norm)

    def to_body(self) -> dict:
        dt = "u1" if self.x.dtype == np.uint8 else "f4"
        body = {"x": encode_array(self.x, dt), "y": encode_array(self.y, "u2"), "classes": self.classes}
        # Additive within version 1: the key travels only with a backbone, so a public set without one is the
        # bytes it always was (and a device of an earlier version, which refuses unknown keys, still reads it).
        if self.backbone is not None:
            body["backbone"] = {
                "params": encode_array(self.backbone, "f4"),
                "mean": None if self.norm is None else self.norm[0],
                "std": None if self.norm is None else self.norm[1],
            }
        if self.graph is not None and self.layout is not None:
            body["lite"] = {"graph": self.graph, "layout": [[n, list(sh)] for n, sh in self.layout]}
        return body

    @classmethod
    def from_body(cls, body: Any, limits: Limits = DEFAULT_LIMITS) -> Self:
        keys = (
            ("x", "y", "classes", "backbone")
            if isinstance(body, dict) and "backbone" in body
            else ("x", "y", "classes")
        )
        if isinstance(body, dict) and "lite" in body:
            keys = (*keys, "lite")
        b = {"backbone": None, "lite": None, **expect_keys(body, keys, cls.KIND)}
        graph, layout = None, None
        if b["lite"] is not None:
            lite = expect_keys(b["lite"], ("graph", "layout"), "public lite")
            graph, layout = lite["graph"], _layout_of(lite["layout"])
        x = decode_array(b["x"], what="public x", limits=limits, dts=("u1", "f4"), ndim=4)
        y = decode_array(b["y"], what="public y", limits=limits, dts=("u2",), ndim=1)
        backbone, norm = None, None
        if b["backbone"] is not None:
            bb = expect_keys(b["backbone"], ("params", "mean", "std"), "public backbone")
            backbone = decode_array(bb["params"], what="public backbone", limits=limits, dts=("f4",), ndim=1)
            if (bb["mean"] is None) != (bb["std"] is None):
                raise WireError("public backbone: mean and std go together")
            if bb["mean"] is not None:
                for k in ("mean", "std"):
                    if not isinstance(bb[k], list) or len(bb[k]) > 16:
                        raise WireError(f"public backbone: {k} must be a list of at most 16 numbers")
                norm = ([expect_float(v, "mean") for v in bb["mean"]], [expect_float(v, "std") for v in bb["std"]])
        return _build(
            cls, cls.KIND, x=x, y=y, classes=b["classes"], backbone=backbone, norm=norm, graph=graph, layout=layout
        )


MAX_GRAPH_BYTES = 4 * 2**20  # a backbone's ONNX graph without its weights: a few KB for the built-in models
MAX_LAYOUT = 4096  # tensors of a backbone


def _layout_of(value: Any) -> list[tuple[str, tuple[int, ...]]]:
    if not isinstance(value, list) or len(value) > MAX_LAYOUT:
        raise WireError(f"public lite layout: expected a list of at most {MAX_LAYOUT} [name, shape] pairs")
    out = []
    for item in value:
        if not isinstance(item, (list, tuple)) or len(item) != 2 or not isinstance(item[1], (list, tuple)):
            raise WireError("public lite layout: expected [name, shape] pairs")
        name = expect_str(item[0], "public lite layout name", MAX_TEXT)
        if len(item[1]) > MAX_NDIM:
            raise WireError(f"public lite layout {printable(name)}: more than {MAX_NDIM} dimensions")
        out.append((name, tuple(expect_int(d, "public lite layout dimension") for d in item[1])))
    return out


def _check_graph(graph: Any, layout: Any, backbone: Any) -> None:
    """The lite graph's checks: with its layout, only beside a backbone, the layout covering the backbone vector."""
    if graph is None and layout is None:
        return
    if graph is None or layout is None:
        raise WireError("lite: the graph and its layout go together")
    if not isinstance(graph, bytes) or not 0 < len(graph) <= MAX_GRAPH_BYTES:
        raise WireError(f"lite graph: expected bytes, at most {MAX_GRAPH_BYTES}")
    if backbone is None:
        raise WireError("lite: a graph only with a backbone")
    total = sum(math.prod(sh) for _, sh in layout)
    if total != np.asarray(backbone).size:
        raise WireError(f"lite layout: {total} values, but the backbone has {np.asarray(backbone).size}")


@dataclass(frozen=True, eq=False)
class ModelUpdate(_Body):
    """The global model g of the ridge predictor's route (protofl/algorithms/ridge.py) as a round message carries
    it: `version`, how many times the server has changed g; `update`, g's new values (float32) at the entries that
    changed when it reached this version (sorted indices of g, a sparse vector of g's length), so that a device
    holding the version before sets them and holds this one bit for bit; `dense`, the whole g (float32), in the
    message after a device said it holds another version (and never otherwise)."""

    version: int
    update: SparseVector
    dense: np.ndarray | None = None

    def __post_init__(self) -> None:
        version = expect_int(self.version, "model version", 0, 2**31 - 1)
        if not isinstance(self.update, SparseVector):
            raise WireError(f"model update: expected a SparseVector, got {type(self.update).__name__}")
        try:
            check_sparse(self.update)
        except ValueError as exc:
            raise WireError(f"model update: {exc}") from None
        values = np.asarray(self.update.values)
        if values.dtype != np.float32 or not np.isfinite(values).all():
            raise WireError("model update: values must be finite float32")
        dense = _opt(self.dense, lambda a: _floats(a, "model dense", 1))
        if dense is not None and dense.shape[0] != self.update.n:
            raise WireError(f"model: dense g of {dense.shape[0]} values, the update's length is {self.update.n}")
        object.__setattr__(self, "version", version)
        object.__setattr__(self, "dense", dense)

    def to_body(self) -> dict:
        return {
            "version": self.version,
            "update": encode_sparse(self.update, "f4"),
            "dense": _opt(self.dense, lambda a: encode_array(a, "f4")),
        }

    @classmethod
    def from_body(cls, body: Any, limits: Limits = DEFAULT_LIMITS) -> ModelUpdate:
        b = expect_keys(body, ("version", "update", "dense"), "round model")
        update = decode_sparse(b["update"], what="round model update", limits=limits)
        if update.values.dtype != np.float32:
            raise WireError("round model update: values must travel f4")
        dense = _opt(
            b["dense"], lambda a: decode_array(a, what="round model dense", limits=limits, dts=("f4",), ndim=1)
        )
        try:
            return cls(version=b["version"], update=update, dense=dense)
        except (TypeError, ValueError) as exc:
            raise WireError(f"round model: {exc}") from None


@dataclass(frozen=True, eq=False)
class RoundStart(_Body):
    """Opens a round phase (number and phase are in the envelope). `dt` is the wire dtype of adapter and
    params; with neither present it does not travel and decodes as "f4"."""

    KIND: ClassVar[str] = "round"
    deadline: float
    adapter: np.ndarray | None = None
    params: np.ndarray | None = None
    targets: ProtoSet | None = None  # the training targets (on the wire: "anchors")
    target_label: str = ""  # what the plan calls them (on the wire: "anchor_kind")
    participants: list[str] | None = None
    final: bool = False
    dt: str = "f4"
    # The global predictor's head (W (C, d), b (C,)) on the shared backbone (the ridge predictor), f4: the final
    # round message carries it, so that every device can keep the federation's predictor beside its own model.
    # Additive within version 1: the key travels only with a head.
    predictor: tuple[np.ndarray, np.ndarray] | None = None
    # The ridge predictor's global model g (its route: protofl/algorithms/ridge.py), where the federation runs it.
    # Additive within version 1: the key travels only with it.
    model: ModelUpdate | None = None

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, ModelUpdate):
            raise WireError(f"model: expected a ModelUpdate, got {type(self.model).__name__}")
        if self.predictor is not None:
            if not isinstance(self.predictor, (tuple, list)) or len(self.predictor) != 2:
                raise WireError("predictor: expected (weight, bias)")
            w, b = _floats(self.predictor[0], "predictor weight", 2), _floats(self.predictor[1], "predictor bias", 1)
            if b.shape[0] != w.shape[0]:
                raise WireError(f"predictor: {w.shape[0]} rows of weights but {b.shape[0]} biases")
            _set(self, predictor=(w, b))
        if self.targets is not None and not isinstance(self.targets, ProtoSet):
            raise WireError(f"targets: expected a ProtoSet, got {type(self.targets).__name__}")
        if self.dt not in FLOAT_DTS:
            raise WireError(f"dt {self.dt!r} is not a float wire dtype (f4, f2, q8)")
        people = self.participants
        if people is not None:
            if not isinstance(people, (list, tuple)):
                raise WireError(f"participants: expected a list, got {type(people).__name__}")
            people = [expect_name(p, "participants") for p in people]
        _set(
            self,
            deadline=expect_float(self.deadline, "deadline", 0.0),
            adapter=_opt(self.adapter, lambda a: _floats(a, "adapter", 1)),
            params=_opt(self.params, lambda a: _floats(a, "params", 1)),
            target_label=expect_str(self.target_label, "anchor_kind"),
            participants=people,
            final=expect_bool(self.final, "final"),
        )

    def to_body(self) -> dict:
        body = {
            "deadline": self.deadline,
            "adapter": _opt(self.adapter, lambda a: encode_array(a, self.dt)),
            "params": _opt(self.params, lambda a: encode_array(a, self.dt)),
            "anchors": _opt(self.targets, ProtoSet.to_body),
            "anchor_kind": self.target_label,
            "participants": self.participants,
            "final": self.final,
        }
        if self.predictor is not None:
            body["predictor"] = [encode_array(self.predictor[0], "f4"), encode_array(self.predictor[1], "f4")]
        if self.model is not None:
            body["model"] = self.model.to_body()
        return body

    @classmethod
    def from_body(cls, body: Any, limits: Limits = DEFAULT_LIMITS) -> Self:
        keys: tuple[str, ...] = ("deadline", "adapter", "params", "anchors", "anchor_kind", "participants", "final")
        if isinstance(body, dict) and "predictor" in body:
            keys = (*keys, "predictor")
        if isinstance(body, dict) and "model" in body:
            keys = (*keys, "model")
        b = expect_keys(body, keys, cls.KIND)
        model = ModelUpdate.from_body(b["model"], limits) if "model" in b else None
        predictor = None
        if "predictor" in b:
            pair = b["predictor"]
            if not isinstance(pair, list) or len(pair) != 2:
                raise WireError("round: predictor must be [weight, bias]")
            predictor = (
                decode_array(pair[0], what="round predictor weight", limits=limits, dts=("f4",), ndim=2),
                decode_array(pair[1], what="round predictor bias", limits=limits, dts=("f4",), ndim=1),
            )
        dense = {k: _opt(b[k], lambda a, k=k: decode_array(a, what=f"round {k}", limits=limits, dts=FLOAT_DTS, ndim=1))
                 for k in ("adapter", "params")}  # fmt: skip
        dts = {b[k]["dt"] for k in ("adapter", "params") if b[k] is not None}
        if len(dts) > 1:
            raise WireError("round: adapter and params must use the same wire dtype")
        anchors = _opt(b["anchors"], lambda a: ProtoSet.from_body(a, limits, "round anchors"))
        return _build(
            cls, cls.KIND, deadline=b["deadline"], targets=anchors, target_label=b["anchor_kind"],
            participants=b["participants"], final=b["final"], dt=dts.pop() if dts else "f4", predictor=predictor,
            model=model, **dense,
        )  # fmt: skip


@dataclass(frozen=True, eq=False)
class ProtoUpload(_Body):
    """A client's prototypes: `local` from its own data, `public` computed on the server's public set."""

    KIND: ClassVar[str] = "protos"
    local: ProtoSet | None
    public: ProtoSet | None
    n_samples: int

    def __post_init__(self) -> None:
        for name in ("local", "public"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, ProtoSet):
                raise WireError(f"{name}: expected a ProtoSet, got {type(v).__name__}")
        _set(self, n_samples=expect_int(self.n_samples, "n_samples"))

    def to_body(self) -> dict:
        return {
            "local": _opt(self.local, ProtoSet.to_body),
            "public": _opt(self.public, ProtoSet.to_body),
            "n_samples": self.n_samples,
        }

    @classmethod
    def from_body(cls, body: Any, limits: Limits = DEFAULT_LIMITS) -> Self:
        b = expect_keys(body, ("local", "public", "n_samples"), cls.KIND)
        return cls._decoded(
            None if b["local"] is None else ProtoSet.from_body(b["local"], limits, "protos local"),
            None if b["public"] is None else ProtoSet.from_body(b["public"], limits, "protos public"),
            b["n_samples"],
        )

    @classmethod
    def _decoded(cls, local: ProtoSet | None, public: ProtoSet | None, n_samples: Any) -> Self:
        """From sets a decoder built: only n_samples is left to check."""
        try:
            n_samples = expect_int(n_samples, "n_samples")
        except WireError as e:
            raise WireError(f"{cls.KIND}: {e}") from None
        return cls._trusted(local, public, n_samples)

    @classmethod
    def _trusted(cls, local: ProtoSet | None, public: ProtoSet | None, n_samples: int) -> Self:
        """From sets and a count a decoder has checked whole (`protofl.wire.fast`: n_samples in [0, 2**63))."""
        out = cls.__new__(cls)
        out.__dict__.update(local=local, public=public, n_samples=n_samples)
        return out


@dataclass(frozen=True, eq=False)
class ParamsUpload(_Body):
    """A client's parameter vector after local training (the federated adapter, or the whole model): every
    value as a dense array, or the coordinates a sparse upload selected."""

    KIND: ClassVar[str] = "adapter"
    update: SparseVector | np.ndarray
    n_samples: int
    base_round: int
    dt: str = "f4"

    def __post_init__(self) -> None:
        u = self.update
        if isinstance(u, SparseVector):
            try:
                n, idx = check_sparse(u)
            except ValueError as e:
                raise WireError(f"update: {e}") from None
            u = SparseVector(n, idx, _floats(u.values, "update values", 1))
        else:
            u = _floats(u, "update", 1)
        _set(self, update=u)
        self._check_scalars(self.n_samples, self.base_round)

    def _check_scalars(self, n_samples: Any, base_round: Any) -> None:
        if self.dt not in FLOAT_DTS:
            raise WireError(f"dt {self.dt!r} is not a float wire dtype (f4, f2, q8)")
        _set(
            self,
            n_samples=expect_int(n_samples, "n_samples"),
            base_round=expect_int(base_round, "base_round", 0, 2**31 - 1),
        )

    def to_body(self) -> dict:
        u = self.update
        enc = encode_sparse(u, self.dt) if isinstance(u, SparseVector) else encode_array(u, self.dt)
        return {"update": enc, "n_samples": self.n_samples, "base_round": self.base_round}

    @classmethod
    def from_body(cls, body: Any, limits: Limits = DEFAULT_LIMITS) -> Self:
        b = expect_keys(body, ("update", "n_samples", "base_round"), cls.KIND)
        u = b["update"]
        if isinstance(u, dict) and "n" in u:
            update: SparseVector | np.ndarray = decode_sparse(u, what="adapter update", limits=limits)
            dt = u["v"]["dt"]
        else:
            update = decode_array(u, what="adapter update", limits=limits, dts=FLOAT_DTS, ndim=1)
            dt = u["dt"]
        return cls._decoded(update, dt, b["n_samples"], b["base_round"])

    @classmethod
    def _decoded(cls, update: SparseVector | np.ndarray, dt: str, n_samples: Any, base_round: Any) -> Self:
        """From an update a decoder checked (here or in `protofl.wire.fast`: indices sorted, unique and in range;
        values finite float32): the constructor's passes over it are not run again, only its checks of the
        scalars."""
        out = cls.__new__(cls)
        _set(out, update=update, dt=dt)
        try:
            out._check_scalars(n_samples, base_round)
        except WireError as e:
            raise WireError(f"{cls.KIND}: {e}") from None
        return out


@dataclass(frozen=True, eq=False)
class Metrics(_Body):
    """A client's evaluation: counts, optional class probabilities on the test set (sent as f2), timings."""

    KIND: ClassVar[str] = "metrics"
    n_local: int
    correct_local: int
    n_test: int
    correct_test: int
    probs: np.ndarray | None = None
    train_s: float = 0.0
    loss: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)
    # Nearest-prototype accuracy (docs/algorithms.md, Evaluation): correct predictions by the nearest global
    # prototype (FedPAGR: cosine to P) on the same splits; None where the device holds no prototypes.
    proto_correct_local: int | None = None
    proto_correct_test: int | None = None

    def __post_init__(self) -> None:
        counts = {k: expect_int(getattr(self, k), k) for k in ("n_local", "correct_local", "n_test", "correct_test")}
        for k in ("proto_correct_local", "proto_correct_test"):
            counts[k] = _opt(getattr(self, k), lambda v, k=k: expect_int(v, k))
        for n, c in (
            ("n_local", "correct_local"),
            ("n_test", "correct_test"),
            ("n_local", "proto_correct_local"),
            ("n_test", "proto_correct_test"),
        ):
            if counts[c] is not None and counts[c] > counts[n]:
                raise WireError(f"{c} = {counts[c]} exceeds {n} = {counts[n]}")
        _set(
            self,
            probs=_opt(self.probs, lambda p: _floats(p, "probs", 2)),
            train_s=expect_float(self.train_s, "train_s", 0.0),
            loss=expect_float(self.loss, "loss"),
            extra=_str_map(self.extra, "extra", expect_float),
            **counts,
        )

    @staticmethod
    def probs_bytes(samples: int, classes: int) -> int:
        """The bytes `probs` adds to a metrics message on a test set of `samples` (f2 values): what a
        receiver adds to `Limits.max_metrics_bytes` when its devices send probabilities (simulation)."""
        return 2 * samples * classes

    def to_body(self) -> dict:
        body = {f.name: getattr(self, f.name) for f in fields(self)}
        body["probs"] = _opt(self.probs, lambda p: encode_array(p, "f2"))
        return body

    @classmethod
    def from_body(cls, body: Any, limits: Limits = DEFAULT_LIMITS) -> Self:
        b = dict(expect_keys(body, [f.name for f in fields(cls)], cls.KIND))
        probs = lambda p: decode_array(p, what="metrics probs", limits=limits, dts=("f2",), ndim=2)  # noqa: E731
        b["probs"] = _opt(b["probs"], probs)
        return _build(cls, cls.KIND, **b)


@dataclass(frozen=True, eq=False)
class Status(_Body):
    """Server or client state for the retained status / presence topics."""

    KIND: ClassVar[str] = "status"
    state: str
    detail: str = ""
    # A device's presence may say what it is now (its power state changes): additive, only with traits.
    traits: Traits | None = None

    def __post_init__(self) -> None:
        expect_str(self.state, "state", MAX_LABEL)
        expect_str(self.detail, "detail", MAX_TEXT)
        _check_traits(self.traits)

    def to_body(self) -> dict:
        body: dict[str, Any] = {"state": self.state, "detail": self.detail}
        if self.traits is not None:
            body["traits"] = self.traits.to_body()
        return body

    @classmethod
    def from_body(cls, body: Any, limits: Limits = DEFAULT_LIMITS) -> Self:
        return _build(cls, cls.KIND, **_with_traits(body, ["state", "detail"], cls.KIND))


@dataclass(frozen=True, eq=False)
class Pace(_Body):
    """Pace steering (issue 47): the server tells one device, on its own `down/{client_id}` topic, that it is not
    in the envelope's round and when to come back (`until`, the server's clock, epoch s), with the reason. The
    device trains nothing for that round and waits for a later round message. Additive within version 1: a device
    that does not know the kind refuses it as unreadable, and the round message's participants leave it out anyway."""

    KIND: ClassVar[str] = "pace"
    until: float
    reason: str = ""

    def __post_init__(self) -> None:
        _set(self, until=expect_float(self.until, "until", 0.0))
        expect_str(self.reason, "reason", MAX_TEXT)

    def to_body(self) -> dict:
        return {"until": self.until, "reason": self.reason}

    @classmethod
    def from_body(cls, body: Any, limits: Limits = DEFAULT_LIMITS) -> Self:
        return _build(cls, cls.KIND, **expect_keys(body, ("until", "reason"), cls.KIND))


def _with_traits(body: Any, keys: list[str], kind: str) -> dict[str, Any]:
    """A body of exactly `keys`, plus "traits" where it has them (additive: the key travels only with traits)."""
    b = dict(expect_keys(body, [*keys, "traits"] if isinstance(body, dict) and "traits" in body else keys, kind))
    if "traits" in b:
        b["traits"] = Traits.from_body(b["traits"])
    return b


def _check_traits(traits: Any) -> None:
    if traits is not None and not isinstance(traits, Traits):
        raise WireError(f"traits: expected Traits, got {type(traits).__name__}")


# The server's time in its retained `server/status`, for a device to check its clock against (`protofl-edge doctor`):
# at the end of the detail, which every device shows as text, so a device of any version reads the status as before.
_SERVER_TIME = re.compile(r"server time (\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)$")


def with_server_time(detail: str, now: float) -> str:
    """`detail` ending with the server's time `now` (seconds since the epoch), within the detail's bound."""
    stamp = "server time " + time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))
    return f"{detail[: MAX_TEXT - len(stamp) - 2]}; {stamp}" if detail else stamp


def server_time(detail: str) -> float | None:
    """The server's time a status detail ends with (`with_server_time`); None where it has none (an older server)."""
    found = _SERVER_TIME.search(detail)
    if found is None:
        return None
    return float(calendar.timegm(time.strptime(found.group(1), "%Y-%m-%dT%H:%M:%SZ")))


@dataclass(frozen=True, eq=False)
class Resend(_Body):
    """The server asks one device to send again what the broker may have dropped after acknowledging it: its
    join (`ask` "join"), its uploads of the envelope's round and phase ("uploads"), or its metrics of the
    envelope's round ("metrics"). Sent on the device's own `down/{client_id}` topic, which only the server may
    write (the ACL). A device that does not know an ask refuses the request as unreadable and sends nothing."""

    KIND: ClassVar[str] = "resend"
    ASKS: ClassVar[tuple[str, ...]] = ("join", "uploads", "metrics")
    ask: str

    def __post_init__(self) -> None:
        if expect_str(self.ask, "ask") not in self.ASKS:
            raise WireError(f"ask: expected one of {', '.join(self.ASKS)}, got {self.ask[:40]!r}")

    def to_body(self) -> dict:
        return {"ask": self.ask}

    @classmethod
    def from_body(cls, body: Any, limits: Limits = DEFAULT_LIMITS) -> Self:
        return _build(cls, cls.KIND, **expect_keys(body, ("ask",), cls.KIND))


# --- secure aggregation (protofl/secagg.py; docs/privacy.md, issue 46) -----------------------------------------
# A device's four messages on `up/` and the server's three on the device's own `down/` topic, for one phase of one
# round (the envelope's). Only the roster names devices: every later message lists its entries in the roster's
# order (the recipient's neighbours, ids sorted), as positions packed in bits where a subset is meant, so no id, no
# Shamir point and no nonce travels twice. Every list is bounded (MAX_NEIGHBOURS entries, its size checked before
# it is walked), every id a valid client id, every byte string of its exact length.
# Wire compatibility: these are the second forms of the kinds `sa_roster`, `sa_shares`, `sa_routed`, `sa_survivors`
# and `sa_unmask` (2026-11-27, in no release: maps keyed by id, 33-byte shares, x in every box and answer), which
# were retired: a peer that sends one is refused from the header as an unknown kind, before its body is read;
# secure aggregation needs devices and server of the same version (`sa_keys`, `sa_masked` are unchanged).
SA_KEY_BYTES = 32  # an X25519 public key
SA_SHARE_BYTES = 32  # an element of GF(2^256 - 189)
SA_BOX_BYTES = 2 * SA_SHARE_BYTES + 16  # AES-GCM of (share of b_u, share of s_u) with its tag
_SA_MASK_BYTES = (MAX_NEIGHBOURS + 7) // 8


def _exact_bytes(v: Any, n: int, what: str) -> bytes:
    if not isinstance(v, bytes) or len(v) != n:
        got = f"{len(v)} bytes" if isinstance(v, bytes) else type(v).__name__
        raise WireError(f"{what}: expected {n} bytes, got {got}")
    return v


def _chunks(v: Any, size: int, what: str) -> list[bytes]:
    """A byte string of whole `size`-byte entries, at most MAX_NEIGHBOURS of them (its length checked first)."""
    if not isinstance(v, bytes):
        raise WireError(f"{what}: expected bytes, got {type(v).__name__}")
    if len(v) % size or len(v) > MAX_NEIGHBOURS * size:
        raise WireError(f"{what}: {len(v)} bytes, not a whole number of {size}-byte entries up to {MAX_NEIGHBOURS}")
    return [v[i : i + size] for i in range(0, len(v), size)]


def _entries(v: Any, size: int, what: str) -> list[bytes]:
    """A sequence of at most MAX_NEIGHBOURS byte strings of `size` bytes each (a message built in Python)."""
    if not isinstance(v, (list, tuple)) or len(v) > MAX_NEIGHBOURS:
        raise WireError(f"{what}: expected a list of at most {MAX_NEIGHBOURS} entries")
    return [_exact_bytes(b, size, f"{what}[{i}]") for i, b in enumerate(v)]


def _positions(v: Any, what: str) -> list[int]:
    """Sorted unique positions in a roster (0 to MAX_NEIGHBOURS - 1)."""
    if not isinstance(v, (list, tuple)) or len(v) > MAX_NEIGHBOURS:
        raise WireError(f"{what}: expected a list of at most {MAX_NEIGHBOURS} positions")
    out = [expect_int(p, what, 0, MAX_NEIGHBOURS - 1) for p in v]
    if any(b <= a for a, b in zip(out, out[1:], strict=False)):
        raise WireError(f"{what}: positions must ascend, each once")
    return out


def _pack_positions(positions: list[int]) -> bytes:
    """Positions as packed bits (bit j of byte k is position 8k + j, as a sparse vector's mask), the shortest."""
    if not positions:
        return b""
    bits = np.zeros(positions[-1] + 1, dtype=np.uint8)
    bits[positions] = 1
    return np.packbits(bits, bitorder="little").tobytes()


def _unpack_positions(v: Any, what: str) -> list[int]:
    """`_pack_positions`' bytes back: at most MAX_NEIGHBOURS bits, the shortest form (its last byte not zero)."""
    if not isinstance(v, bytes) or len(v) > _SA_MASK_BYTES:
        raise WireError(f"{what}: expected at most {_SA_MASK_BYTES} bytes of packed positions")
    if v and v[-1] == 0:
        raise WireError(f"{what}: a last byte of zero bits (the shortest form is sent)")
    return np.flatnonzero(np.unpackbits(np.frombuffer(v, dtype=np.uint8), bitorder="little")).tolist()


@dataclass(frozen=True, eq=False)
class SaKeys(_Body):
    """Secure aggregation, step 0 (device): its two X25519 public keys for the phase (`c` encrypts the shares sent
    to it, `s` agrees its pairwise masks)."""

    KIND: ClassVar[str] = "sa_keys"
    c: bytes
    s: bytes

    def __post_init__(self) -> None:
        _exact_bytes(self.c, SA_KEY_BYTES, "c")
        _exact_bytes(self.s, SA_KEY_BYTES, "s")

    def to_body(self) -> dict:
        return {"c": self.c, "s": self.s}

    @classmethod
    def from_body(cls, body: Any, limits: Limits = DEFAULT_LIMITS) -> Self:
        return _build(cls, cls.KIND, **expect_keys(body, ("c", "s"), cls.KIND))


@dataclass(frozen=True, eq=False)
class SaRoster(_Body):
    """Secure aggregation, the server to one device: its neighbours' keys (id -> (c, s)), the threshold t of the
    Shamir shares, and the ring: values within +-`bound` (clipped on the device), `frac_bits` of fixed point;
    `weighted`: each class's row goes times its count n_kc, and its weight is n_kc (else 1): the server rule's.
    On the wire: `ids` (sorted: the roster's order, which every later message of the phase follows) and `keys`
    (c then s of each, 64 bytes an id, in that order)."""

    KIND: ClassVar[str] = "sa_roster2"
    keys: dict[str, tuple[bytes, bytes]]
    t: int
    frac_bits: int
    bound: float
    weighted: bool

    def __post_init__(self) -> None:
        if not isinstance(self.keys, dict) or len(self.keys) > MAX_NEIGHBOURS:
            raise WireError(f"keys: expected a map of at most {MAX_NEIGHBOURS} entries")
        for k, v in self.keys.items():
            expect_name(k, "keys id")
            if not isinstance(v, (list, tuple)) or len(v) != 2:
                raise WireError(f"keys[{k}]: expected (c, s)")
            _exact_bytes(v[0], SA_KEY_BYTES, f"keys[{k}] c")
            _exact_bytes(v[1], SA_KEY_BYTES, f"keys[{k}] s")
        _set(self, keys={k: (self.keys[k][0], self.keys[k][1]) for k in sorted(self.keys)})
        _set(
            self, t=expect_int(self.t, "t", 1, MAX_NEIGHBOURS), frac_bits=expect_int(self.frac_bits, "frac_bits", 0, 30)
        )
        _set(self, bound=expect_float(self.bound, "bound", 0.0), weighted=expect_bool(self.weighted, "weighted"))
        if self.bound <= 0:
            raise WireError("bound: must be > 0")

    @property
    def order(self) -> list[str]:
        """The roster's order: the neighbours' ids, sorted."""
        return list(self.keys)

    def to_body(self) -> dict:
        keys = b"".join(c + s for c, s in self.keys.values())
        return {
            "ids": list(self.keys),
            "keys": keys,
            "t": self.t,
            "frac_bits": self.frac_bits,
            "bound": self.bound,
            "weighted": self.weighted,
        }

    @classmethod
    def from_body(cls, body: Any, limits: Limits = DEFAULT_LIMITS) -> Self:
        b = expect_keys(body, ("ids", "keys", "t", "frac_bits", "bound", "weighted"), cls.KIND)
        ids = b["ids"]
        if not isinstance(ids, list) or len(ids) > MAX_NEIGHBOURS:
            raise WireError(f"ids: expected a list of at most {MAX_NEIGHBOURS} client ids")
        ids = [expect_name(i, "ids") for i in ids]
        if any(b2 <= a for a, b2 in zip(ids, ids[1:], strict=False)):
            raise WireError("ids: must be sorted, each once")
        raw = _exact_bytes(b["keys"], 2 * SA_KEY_BYTES * len(ids), "keys")
        n = SA_KEY_BYTES
        keys = {i: (raw[2 * n * j : 2 * n * j + n], raw[2 * n * j + n : 2 * n * (j + 1)]) for j, i in enumerate(ids)}
        return _build(
            cls, cls.KIND, keys=keys, t=b["t"], frac_bits=b["frac_bits"], bound=b["bound"], weighted=b["weighted"]
        )


@dataclass(frozen=True, eq=False)
class SaShares(_Body):
    """Secure aggregation, step 1 (device): its encrypted Shamir shares, one box per neighbour in the roster's
    order (`boxes`; on the wire one byte string of SA_BOX_BYTES a neighbour)."""

    KIND: ClassVar[str] = "sa_shares2"
    boxes: list[bytes]

    def __post_init__(self) -> None:
        _set(self, boxes=_entries(self.boxes, SA_BOX_BYTES, "boxes"))

    def to_body(self) -> dict:
        return {"boxes": b"".join(self.boxes)}

    @classmethod
    def from_body(cls, body: Any, limits: Limits = DEFAULT_LIMITS) -> Self:
        b = expect_keys(body, ("boxes",), cls.KIND)
        return _build(cls, cls.KIND, boxes=_chunks(b["boxes"], SA_BOX_BYTES, "boxes"))


@dataclass(frozen=True, eq=False)
class SaRouted(_Body):
    """Secure aggregation, the server to one device: the boxes its neighbours sent it, `senders` their positions in
    its roster (ascending; on the wire packed bits) and `boxes` in that order; the senders are the neighbours whose
    pairwise masks its masked input carries."""

    KIND: ClassVar[str] = "sa_routed2"
    senders: list[int]
    boxes: list[bytes]

    def __post_init__(self) -> None:
        _set(self, senders=_positions(self.senders, "senders"), boxes=_entries(self.boxes, SA_BOX_BYTES, "boxes"))
        if len(self.senders) != len(self.boxes):
            raise WireError(f"boxes: {len(self.boxes)} for {len(self.senders)} senders")

    def to_body(self) -> dict:
        return {"senders": _pack_positions(self.senders), "boxes": b"".join(self.boxes)}

    @classmethod
    def from_body(cls, body: Any, limits: Limits = DEFAULT_LIMITS) -> Self:
        b = expect_keys(body, ("senders", "boxes"), cls.KIND)
        senders = _unpack_positions(b["senders"], "senders")
        return _build(cls, cls.KIND, senders=senders, boxes=_chunks(b["boxes"], SA_BOX_BYTES, "boxes"))


@dataclass(frozen=True, eq=False)
class SaMasked(_Body):
    """Secure aggregation, step 2 (device): its masked input, the fixed-point vector plus its masks mod 2^32 (u4).
    `blame`: the positions in its roster of the neighbours whose routed boxes did not decrypt (its masked input
    carries no pair mask with them); on the wire packed bits, and only where it names somebody (the message
    without it is the same bytes as before the field came)."""

    KIND: ClassVar[str] = "sa_masked"
    y: np.ndarray
    blame: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        y = np.asarray(self.y)
        if y.ndim != 1 or y.dtype != np.uint32:
            raise WireError(f"y: expected a 1-D uint32 vector, got {y.dtype} of shape {list(y.shape)}")
        _set(self, blame=_positions(self.blame, "blame"))

    def to_body(self) -> dict:
        body: dict[str, Any] = {"y": encode_array(self.y, "u4")}
        if self.blame:
            body["blame"] = _pack_positions(self.blame)
        return body

    @classmethod
    def from_body(cls, body: Any, limits: Limits = DEFAULT_LIMITS) -> Self:
        named = isinstance(body, dict) and "blame" in body
        b = expect_keys(body, ("y", "blame") if named else ("y",), cls.KIND)
        blame = _unpack_positions(b["blame"], "blame") if named else []
        if named and not blame:
            raise WireError("blame: names nobody (left out where it names nobody)")
        y = decode_array(b["y"], what="y", limits=limits, dts=("u4",), ndim=1)
        return _build(cls, cls.KIND, y=y, blame=blame)


@dataclass(frozen=True, eq=False)
class SaSurvivors(_Body):
    """Secure aggregation, the server to one device: which of its neighbours sent a masked input (the others
    dropped), as their positions in its roster (ascending; on the wire packed bits): it answers with its shares
    of their self-mask seeds, and of the others' mask keys."""

    KIND: ClassVar[str] = "sa_survivors2"
    alive: list[int]

    def __post_init__(self) -> None:
        _set(self, alive=_positions(self.alive, "alive"))

    def to_body(self) -> dict:
        return {"alive": _pack_positions(self.alive)}

    @classmethod
    def from_body(cls, body: Any, limits: Limits = DEFAULT_LIMITS) -> Self:
        b = expect_keys(body, ("alive",), cls.KIND)
        return _build(cls, cls.KIND, alive=_unpack_positions(b["alive"], "alive"))


@dataclass(frozen=True, eq=False)
class SaUnmask(_Body):
    """Secure aggregation, step 3 (device): for each neighbour u whose box it was routed, in the roster's order, its
    share of u's self-mask seed if u survived, else of u's mask key: the survivors list it answers says which, so
    neither the kind nor u nor the point x travels (never both kinds for one u: the device refuses). On the wire
    one byte string of SA_SHARE_BYTES an answer."""

    KIND: ClassVar[str] = "sa_unmask2"
    shares: list[bytes]

    def __post_init__(self) -> None:
        _set(self, shares=_entries(self.shares, SA_SHARE_BYTES, "shares"))

    def to_body(self) -> dict:
        return {"shares": b"".join(self.shares)}

    @classmethod
    def from_body(cls, body: Any, limits: Limits = DEFAULT_LIMITS) -> Self:
        b = expect_keys(body, ("shares",), cls.KIND)
        return _build(cls, cls.KIND, shares=_chunks(b["shares"], SA_SHARE_BYTES, "shares"))


SECAGG_MESSAGES = (SaKeys, SaRoster, SaShares, SaRouted, SaMasked, SaSurvivors, SaUnmask)
SecAggMessage = SaKeys | SaRoster | SaShares | SaRouted | SaMasked | SaSurvivors | SaUnmask

Message = (
    Join
    | Config
    | PublicSet
    | RoundStart
    | ProtoUpload
    | ParamsUpload
    | Metrics
    | Status
    | Resend
    | Pace
    | SecAggMessage
)
_CLASSES = (
    Join,
    Config,
    PublicSet,
    RoundStart,
    ProtoUpload,
    ParamsUpload,
    Metrics,
    Status,
    Resend,
    Pace,
    *SECAGG_MESSAGES,
)
MESSAGE_TYPES: dict[str, type] = {c.KIND: c for c in _CLASSES}
# How each kind's body is read (typed: every message class has `from_body(body, limits)`).
_FROM_BODY: dict[str, Callable[[Any, Limits], Message]] = {c.KIND: c.from_body for c in _CLASSES}
assert set(MESSAGE_TYPES) == KINDS, "codec.KINDS and MESSAGE_TYPES must list the same kinds"


def encode_message(
    msg: Message, *, fed: str, sender: str, round: int = 0, phase: str = "", msg_id: str | None = None
) -> bytes:
    """Wrap `msg` in an envelope and serialise it; raises ValueError if the envelope is invalid."""
    if MESSAGE_TYPES.get(getattr(msg, "KIND", None)) is not type(msg):  # type: ignore[arg-type]
        raise TypeError(f"not a wire message: {type(msg).__name__}")
    msg_id = uuid.uuid4().hex[:16] if msg_id is None else msg_id
    return pack_envelope(Envelope(WIRE_VERSION, msg.KIND, fed, round, phase, sender, msg_id, msg.to_body()))


def decode_body(env: Envelope, limits: Limits = DEFAULT_LIMITS) -> Message:
    """Validate the body of an envelope whose fields the receiver has checked already (`read_header`,
    then `Header.open`); every failure is a WireError naming the field, sender and round."""
    try:
        return _FROM_BODY[env.kind](env.body, limits)
    except WireError as e:
        raise WireError(f"{e} (sender {env.sender}, round {env.round})") from None
    except Exception as e:  # a validation gap must still not crash the receiver
        raise WireError(
            f"{env.kind}: unexpected {type(e).__name__} ({e}) (sender {env.sender}, round {env.round}); this is a "
            f"bug in protofl.wire, please report"
        ) from e


def decode_message(data: bytes, *, limits: Limits = DEFAULT_LIMITS) -> tuple[Envelope, Message]:
    """Parse and validate envelope and body (a receiver that checks the envelope first uses
    `read_header` and `decode_body`); every failure is a WireError."""
    env = unpack_envelope(data, limits)
    return env, decode_body(env, limits)


def message_size(msg: Message, **envelope_kwargs: Any) -> int:
    """Encoded bytes of `msg` (fed and sender default to short placeholder names)."""
    envelope_kwargs.setdefault("fed", "fed")
    envelope_kwargs.setdefault("sender", "client-0000")
    return len(encode_message(msg, **envelope_kwargs))
