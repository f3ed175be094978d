"""Deployable artifacts: what a run leaves behind for deployment, in one versioned layout (numpy only).

Every run writes it: `simulate --out DIR` (the federation and every device), `start` (the federation, in
`STATE_DIR/artifacts`) and `join --state-dir DIR` (its device, in `DIR/artifacts`). The export tools and
`protofl-edge predict` read it; nothing in it is pickled (npz with ``allow_pickle=False``, JSON):

    ROOT/manifest.json                what wrote it, federation, preset, round, config, class names, and the
                                      global predictor: its kind, or the reason the preset has none
    ROOT/global/prototypes.npz        the federation's prototypes at full width (masked ones expanded)
    ROOT/global/federated.npz         the federated parameter vector (the global model, or adapter and head),
                                      where the preset federates one
    ROOT/devices/<id>/model.npz       the device's model: its state_dict and how to rebuild it (`spec`)
    ROOT/devices/<id>/prototypes.npz  the table the device classifies with (the global prototypes as it
                                      decodes them, else its own class means)
    ROOT/devices/<id>/local_prototypes.npz   its own class means at full width, with their counts
    ROOT/devices/<id>/device.json     id, federation, rounds trained, config, class names

A prototype file holds ``classes`` (C,) int64 and ``prototypes`` (C, m) float32, and optionally
``metric`` ("l2" or "cosine": how to compare features with them), ``class_names`` (C,), ``counts``,
``masks`` (C, m) and ``source`` ("global" or "local"). docs/design.md (section 9) has the contract.
"""

from __future__ import annotations

import json
import math
import os
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from protofl.errors import DataError

if TYPE_CHECKING:
    from protofl.config import FederationConfig

__all__ = [
    "FORMAT",
    "METRICS",
    "VERSION",
    "Artifact",
    "PrototypeFile",
    "device_dir",
    "predictor_kind",
    "read_json",
    "read_model",
    "read_prototypes",
    "read_vector",
    "resolve",
    "write_json",
    "write_model",
    "write_prototypes",
    "write_predictor",
    "read_predictor",
    "write_vector",
]

FORMAT = "protofl-artifacts"
VERSION = 1
METRICS = ("l2", "cosine")
MANIFEST, GLOBAL, DEVICES = "manifest.json", "global", "devices"
ARTIFACTS = "artifacts"  # where a --state-dir (start's, join's) keeps them
MODEL, PROTOTYPES, LOCAL, FEDERATED, DEVICE = (
    "model.npz",
    "prototypes.npz",
    "local_prototypes.npz",
    "federated.npz",
    "device.json",
)
PREDICTOR = "predictor.npz"  # a global head on the shared backbone (protofl/algorithms/ridge.py), and the backbone


def device_dir(root: str | os.PathLike[str], client_id: str) -> Path:
    return Path(root) / DEVICES / client_id


def predictor_kind(cfg: FederationConfig) -> tuple[str | None, str]:
    """The global predictor a federation of `cfg` defines -- one model a new device could be given -- and
    why: ("model", ...) every parameter federated; ("adapter", ...) the federated adapter and head on a
    backbone that every device holds identically; (None, the reason there is none).

    Read from the config's core fields only (what is federated, the backbone, the architectures), so that
    it holds for any technique. A private stem or projection between backbone and adapter is found where
    the model is built (torch); the simulator adds that reason itself.
    """
    if cfg.federate == "full":
        return "model", "every parameter is federated: the aggregated model"
    if cfg.draft.shared_backbone:
        if (
            float(cfg.options.get("ridge_topk", 0) or 0) > 0
        ):  # the ridge predictor's route (protofl/algorithms/ridge.py)
            return "head", (
                "the global model g: the shared backbone every device was sent with a global head solved from the "
                "devices' statistics (ridge), both refreshed each round by the devices' sparse updates"
            )
        return "head", (
            "a global head solved from the devices' statistics (ridge), on the shared backbone every device was sent"
        )
    if cfg.federate == "adapter":
        if len(set(cfg.archs)) > 1:
            return None, (
                "the devices run different architectures: the federated adapter and head have no one backbone to sit on"
            )
        if cfg.backbone != "frozen":
            return None, (
                "the adapter and head are federated, but every device trains its own backbone "
                "(backbone=train): no single model a new device could be given; with "
                "--set backbone=frozen every device keeps the same seeded backbone and there is one"
            )
        return "adapter", "the federated adapter and head on the shared frozen backbone (seeded alike everywhere)"
    return None, (
        "only prototypes are federated and every backbone stays on its device: a new device "
        "classifies by nearest global prototype on its own backbone"
    )


# -- files ------------------------------------------------------------------------------------------


def _atomic_npz(path: Path, arrays: Mapping[str, np.ndarray]) -> Path:
    """Write an npz without pickle, replacing `path` only once it is complete."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as fh:  # a handle: np.savez would append ".npz" to the temporary name
        np.savez(fh, **arrays)  # type: ignore[arg-type]  # numpy's stub lets **arrays reach allow_pickle
    os.replace(tmp, path)
    return path


# The most bytes the arrays of one file of each kind may declare (issue 43): every member's npy header is read
# before any array is, so a small npz that declares gigabytes of zeros is refused without allocating them.
MiB = 1 << 20
MAX_NPZ_BYTES = {"prototype table": 256 * MiB}
MAX_NPZ_BYTES_DEFAULT = 512 * MiB  # a model file, the federated vector, a global predictor with its backbone


def _declared_bytes(path: Path, what: str) -> int:
    """The bytes the arrays of the npz at `path` declare, from their headers alone (no array is read); a
    DataError for a member that is not an npy array, an object array, or more bytes than `what` may hold."""
    limit = MAX_NPZ_BYTES.get(what, MAX_NPZ_BYTES_DEFAULT)
    total = 0
    with zipfile.ZipFile(path) as zf:
        for name in zf.namelist():
            if not name.endswith(".npy"):
                raise DataError(f"{path}: member {name!r} is not an .npy array; a {what} holds only arrays")
            with zf.open(name) as m:
                version = np.lib.format.read_magic(m)
                if version == (1, 0):
                    shape, _, dtype = np.lib.format.read_array_header_1_0(m)
                elif version == (2, 0):
                    shape, _, dtype = np.lib.format.read_array_header_2_0(m)
                else:
                    raise DataError(f"{path}: member {name!r} is npy format {version}; protofl reads 1.0 and 2.0")
            if dtype.hasobject:
                raise DataError(f"{path}: member {name!r} holds Python objects; a {what} holds numbers and text")
            total += math.prod(shape) * dtype.itemsize
            if total > limit:
                raise DataError(
                    f"{path}: its arrays declare more than {limit // MiB} MiB (member {name!r}: shape {shape}, "
                    f"{dtype}); a {what} is never that large: refused before reading it"
                )
    return total


def _load_npz(path: Path, what: str) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise DataError(f"{what} {path} does not exist")
    try:
        _declared_bytes(path, what)
    except DataError:
        raise  # already says what is wrong with which member
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise DataError(f"{path}: cannot read as .npz ({exc})") from None
    try:
        with np.load(path, allow_pickle=False) as f:
            return {k: f[k] for k in f.files}
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: cannot read as .npz ({exc})") from None


def write_json(path: Path, obj: Mapping[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def read_json(path: Path) -> dict[str, Any]:
    try:
        obj = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"{path} does not exist") from None
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: cannot read as JSON ({exc})") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise DataError(f"{path} is not a protofl artifact file (format {FORMAT!r})")
    if int(obj.get("version", 0)) > VERSION:
        raise DataError(
            f"{path} is artifact format version {obj['version']}; this protofl-edge reads up to {VERSION}: upgrade it"
        )
    return obj


def stamp(**fields: Any) -> dict[str, Any]:
    """The head every artifact JSON starts with."""
    return {"format": FORMAT, "version": VERSION, **fields}


@dataclass(frozen=True)
class PrototypeFile:
    """A prototype table as `predict` uses it."""

    classes: np.ndarray  # (C,) int64
    values: np.ndarray  # (C, m) float32
    metric: str | None = None  # None: the file does not say (then l2)
    class_names: tuple[str, ...] | None = None
    source: str = ""

    def table(self) -> dict[int, np.ndarray]:
        return {int(c): self.values[i] for i, c in enumerate(self.classes)}

    def name_of(self, c: int) -> str:
        if self.class_names is None:
            return str(c)
        return self.class_names[int(np.flatnonzero(self.classes == c)[0])]


def write_prototypes(
    path: str | os.PathLike[str],
    table: Mapping[int, np.ndarray],
    *,
    metric: str | None = None,
    class_names: Sequence[str] | None = None,
    source: str = "",
    counts: Mapping[int, int] | None = None,
    masks: np.ndarray | None = None,
) -> Path:
    """A prototype file (module docstring); `class_names` are the federation's, indexed by class id."""
    if metric is not None and metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
    classes = np.array(sorted(int(c) for c in table), dtype=np.int64)
    width = len(next(iter(table.values()))) if table else 0
    values = (
        np.stack([np.asarray(table[int(c)], np.float32) for c in classes])
        if len(classes)
        else np.zeros((0, width), np.float32)
    )
    arrays: dict[str, np.ndarray] = {"classes": classes, "prototypes": values}
    if metric is not None:
        arrays["metric"] = np.array(metric)
    if class_names is not None:
        arrays["class_names"] = np.array(
            [str(class_names[int(c)]) if int(c) < len(class_names) else str(int(c)) for c in classes]
        )
    if source:
        arrays["source"] = np.array(source)
    if counts is not None:
        arrays["counts"] = np.array([int(counts.get(int(c), 0)) for c in classes], dtype=np.int64)
    if masks is not None:
        arrays["masks"] = np.asarray(masks, dtype=np.uint8)
    return _atomic_npz(Path(path), arrays)


def read_prototypes(path: str | os.PathLike[str]) -> PrototypeFile:
    """A prototype file, checked (any npz with ``classes`` and ``prototypes`` will do)."""
    p = Path(path)
    if not p.is_file():
        raise DataError(
            f"prototype table {p} does not exist; pass --fit to build it from the training split, "
            "or point --prototypes at an .npz with 'classes' and 'prototypes' (protofl-export onnx "
            "--from ARTIFACT writes one beside the model)"
        )
    arrays = _load_npz(p, "prototype table")
    if "classes" not in arrays or "prototypes" not in arrays:
        raise DataError(f"{p}: needs arrays 'classes' (C,) and 'prototypes' (C, m); found {sorted(arrays)}")
    classes, values = arrays["classes"], arrays["prototypes"]
    if classes.ndim != 1 or values.ndim != 2 or len(classes) != len(values) or len(classes) == 0:
        raise DataError(
            f"{p}: 'classes' must be (C,) and 'prototypes' (C, m) with C >= 1, got {classes.shape} and {values.shape}"
        )
    if not np.issubdtype(classes.dtype, np.integer) or not np.isfinite(values).all():
        raise DataError(f"{p}: classes must be integers and prototypes finite")
    metric = str(arrays["metric"]) if "metric" in arrays else None
    if metric is not None and metric not in METRICS:
        raise DataError(f"{p}: metric {metric!r} is not one of {', '.join(METRICS)}")
    names = tuple(str(n) for n in arrays["class_names"]) if "class_names" in arrays else None
    if names is not None and len(names) != len(classes):
        raise DataError(f"{p}: {len(names)} class names for {len(classes)} classes")
    return PrototypeFile(
        classes.astype(np.int64),
        values.astype(np.float32),
        metric,
        names,
        str(arrays["source"]) if "source" in arrays else "",
    )


def write_model(path: str | os.PathLike[str], state: Mapping[str, np.ndarray], spec: Mapping[str, Any]) -> Path:
    """A model as its state_dict arrays (``state/<name>``) and its description (``spec``, JSON)."""
    arrays = {f"state/{k}": np.asarray(v) for k, v in state.items()}
    arrays["spec"] = np.array(json.dumps(stamp(**spec), sort_keys=True))
    return _atomic_npz(Path(path), arrays)


def read_model(path: str | os.PathLike[str]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(state_dict arrays, spec) of a model file written by :func:`write_model`."""
    p = Path(path)
    arrays = _load_npz(p, "model file")
    if "spec" not in arrays:
        raise DataError(
            f"{p} is not a protofl model file (no 'spec'); export tools read a device's "
            f"{DEVICES}/<id>/{MODEL} or a torch checkpoint"
        )
    spec = json.loads(str(arrays.pop("spec")))
    if spec.get("format") != FORMAT or int(spec.get("version", 0)) > VERSION:
        raise DataError(
            f"{p}: model file format {spec.get('format')!r} version {spec.get('version')}; this "
            f"protofl-edge reads {FORMAT!r} up to version {VERSION}"
        )
    return {k.removeprefix("state/"): v for k, v in arrays.items() if k.startswith("state/")}, spec


def write_vector(path: str | os.PathLike[str], vector: np.ndarray, kind: str) -> Path:
    """A federated parameter vector and its kind: "model" (every parameter, in state_dict order) or "adapter"
    (adapter and head, in the config's adapter layout)."""
    return _atomic_npz(Path(path), {"vector": np.asarray(vector, np.float32), "kind": np.array(kind)})


def write_predictor(
    path: str | os.PathLike[str], weight: np.ndarray, bias: np.ndarray, backbone: np.ndarray | None, info: dict
) -> Path:
    """A global head (W (C, d), b (C,)) and the shared backbone it sits on (the whole parameter vector of the
    federation's first architecture; absent: the seeded initial model), with what it was made from (`info`)."""
    arrays = {
        "head_weight": np.asarray(weight, np.float32),
        "head_bias": np.asarray(bias, np.float32),
        "info": np.array(json.dumps(info, sort_keys=True)),
    }
    if backbone is not None:
        arrays["backbone"] = np.asarray(backbone, np.float32)
    return _atomic_npz(Path(path), arrays)


def read_predictor(path: str | os.PathLike[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, dict]:
    """(W, b, the backbone vector or None, info) of `write_predictor`."""
    arrays = _load_npz(Path(path), "global predictor")
    if "head_weight" not in arrays or "head_bias" not in arrays:
        raise DataError(f"{path}: needs arrays 'head_weight' and 'head_bias'; found {sorted(arrays)}")
    w, b = arrays["head_weight"].astype(np.float32), arrays["head_bias"].astype(np.float32)
    if w.ndim != 2 or b.shape != (w.shape[0],) or not (np.isfinite(w).all() and np.isfinite(b).all()):
        raise DataError(f"{path}: head_weight (C, d) and head_bias (C,) must be finite, got {w.shape}, {b.shape}")
    backbone = arrays["backbone"].astype(np.float32) if "backbone" in arrays else None
    info = json.loads(str(arrays["info"])) if "info" in arrays else {}
    return w, b, backbone, info


def read_vector(path: str | os.PathLike[str]) -> tuple[np.ndarray, str]:
    arrays = _load_npz(Path(path), "federated parameters")
    if "vector" not in arrays or "kind" not in arrays:
        raise DataError(f"{path}: needs arrays 'vector' and 'kind'; found {sorted(arrays)}")
    return arrays["vector"].astype(np.float32), str(arrays["kind"])


# -- what a path names -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Artifact:
    """What `--from PATH` names: a device's artifact, or the federation's global state."""

    path: Path  # the device's folder, or the global folder
    kind: str  # "device" | "global" | "predictor" (a global predictor's file, the run's or a device's copy)
    info: dict[str, Any]  # device.json, or the manifest

    @property
    def prototypes(self) -> Path:
        return self.path / PROTOTYPES

    @property
    def model(self) -> Path:
        return self.path / MODEL

    @property
    def federated(self) -> Path:
        return self.path / FEDERATED

    @property
    def predictor(self) -> Path:
        return self.path / PREDICTOR

    @property
    def class_names(self) -> list[str] | None:
        names = self.info.get("class_names")
        return [str(n) for n in names] if names else None


def resolve(path: str | os.PathLike[str], device: str | None = None) -> Artifact:
    """The artifact at `path`: a device folder (it holds model.npz), a global folder, or a run's root
    (then `device` picks one of its devices, else its global state); a --state-dir (start's, join's) stands for
    its artifacts/ folder."""
    p = Path(path)
    if p.name == PREDICTOR and p.is_file():  # a global predictor: the run's (global/), or kept by a device
        if (p.parent.parent / MANIFEST).is_file() and p.parent.name == GLOBAL:
            return Artifact(p.parent, "predictor", read_json(p.parent.parent / MANIFEST))
        if (p.parent / DEVICE).is_file():
            return Artifact(p.parent, "predictor", read_json(p.parent / DEVICE))
        raise DataError(f"{p}: a global predictor needs its run's {MANIFEST} or its device's {DEVICE} beside it")
    if p.name == GLOBAL and (p.parent / MANIFEST).is_file():  # its folder is made with its first file
        return Artifact(p, "global", read_json(p.parent / MANIFEST))
    if not p.exists():
        raise DataError(
            f"artifact {p} does not exist; a run writes them (simulate --out DIR, start --state-dir "
            f"DIR: DIR/artifacts, join --state-dir DIR: DIR/artifacts)"
        )
    if (p / MODEL).is_file():
        return Artifact(p, "device", read_json(p / DEVICE))
    inner = p / ARTIFACTS
    if not (p / MANIFEST).is_file() and ((inner / MANIFEST).is_file() or (inner / DEVICES).is_dir()):
        return resolve(inner, device)  # a --state-dir (start's, or join's: its devices/ folder is the device's state)
    if (p / MANIFEST).is_file() or (p / DEVICES).is_dir():
        if device is not None:
            return resolve(device_dir(p, device))
        if (p / MANIFEST).is_file():
            return Artifact(p / GLOBAL, "global", read_json(p / MANIFEST))
        found = sorted(d.name for d in (p / DEVICES).iterdir() if (d / MODEL).is_file())
        if len(found) == 1:  # a device's own run (join --state-dir): its one device
            return resolve(device_dir(p, found[0]))
        raise DataError(f"{p} holds device artifacts only: name one with --device ({', '.join(found) or 'none'})")
    raise DataError(
        f"{p} is not a protofl artifact folder: expected {MODEL} (a device), {MANIFEST} (a run), "
        f"the {GLOBAL}/ folder of a run, or a --state-dir with an {ARTIFACTS}/ folder"
    )
