"""Verify an exported model: the ONNX checker, then parity with PyTorch on real inputs.

Parity is the maximum absolute difference between onnxruntime's and torch's outputs over real images,
run in batches of 1, 7 and then 64 so that the dynamic batch axis is exercised with more than the
export's example size. Above the tolerance the result fails and says by how much, where, and what to
check.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from edge_agent.inference.onnx_export import graph_of
from edge_agent.inference.onnx_runtime import read_metadata, session
from edge_agent.training.models import ProtoNet
from protofl.errors import ConfigError

__all__ = ["VerifyResult", "verify_onnx"]

BATCHES = (1, 7)  # then the rest in batches of 64


@dataclass
class VerifyResult:
    path: Path
    ok: bool
    checker: str  # "ok" or the checker's message
    max_abs_diff: float = float("nan")
    mean_abs_diff: float = float("nan")
    tol: float = 1e-4
    n_samples: int = 0
    batch_sizes: tuple[int, ...] = ()
    worst_sample: int = -1
    problems: list[str] = field(default_factory=list)

    def summary(self) -> str:
        head = "PASS" if self.ok else "FAIL"
        figures = (
            f"max |onnx - torch| = {self.max_abs_diff:.3g} (tolerance {self.tol:g}), "
            f"mean {self.mean_abs_diff:.3g}, over {self.n_samples} real images in batches "
            f"{', '.join(str(b) for b in self.batch_sizes)}"
        )
        if self.max_abs_diff == self.max_abs_diff and self.worst_sample >= 0:  # not NaN
            figures += f"; worst image #{self.worst_sample}"
        lines = [f"{head} {self.path}: checker {self.checker}; {figures}"]
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)


def _batches(n: int) -> list[tuple[int, int]]:
    spans, i = [], 0
    for b in BATCHES:
        if i >= n:
            break
        spans.append((i, min(n, i + b)))
        i += b
    spans += [(j, min(n, j + 64)) for j in range(i, n, 64)]
    return spans


@torch.inference_mode()
def _torch_outputs(model: ProtoNet, what: str, x: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    was = {m: m.training for m in model.modules()}
    model.eval()
    try:
        fn = graph_of(model, what)
        return np.concatenate([fn(torch.from_numpy(x[a:b])).cpu().numpy() for a, b in spans])
    finally:
        for m, flag in was.items():
            m.training = flag


def verify_onnx(
    path: str | os.PathLike[str], model: ProtoNet, x: np.ndarray, tol: float = 1e-4, threads: int | None = None
) -> VerifyResult:
    """Check ``path`` and compare it with ``model`` (the same ``what`` as its metadata) on images ``x``."""
    import onnx

    p = Path(path)
    meta = read_metadata(p)  # raises a clear ConfigError for a missing file
    what = meta.get("what", "features")
    result = VerifyResult(p, ok=False, checker="ok", tol=tol)
    try:
        onnx.checker.check_model(str(p), full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        result.checker = f"failed: {str(exc).splitlines()[0]}"
        result.problems.append("the file is not a valid ONNX model; re-export it with `protofl-export onnx`")
        return result
    if meta.get("arch") and meta["arch"] != model.arch:
        result.problems.append(
            f"the ONNX file was exported from '{meta['arch']}' but compared with '{model.arch}': "
            f"pass --arch {meta['arch']} (and its checkpoint)"
        )
    if x.ndim != 4 or tuple(x.shape[1:]) != tuple(model.in_shape):
        raise ConfigError(f"verification images have shape {x.shape[1:]} but the model takes {model.in_shape}")
    spans = _batches(len(x))
    sess = session(p, threads, spin=False)
    name = sess.get_inputs()[0].name
    got = np.concatenate([sess.run(None, {name: np.ascontiguousarray(x[a:b])})[0] for a, b in spans])
    ref = _torch_outputs(model, what, x, spans)
    result.n_samples = len(x)
    result.batch_sizes = tuple(sorted({b - a for a, b in spans}))
    if got.shape != ref.shape:
        result.problems.append(
            f"output shapes differ: onnx {got.shape}, torch {what} {ref.shape}; wrong --arch, --proto-dim or --what?"
        )
        return result
    diff = np.abs(got.astype(np.float64) - ref.astype(np.float64))
    if not np.isfinite(diff).all():
        result.problems.append("non-finite outputs (NaN/inf) from one of the runtimes")
        return result
    per_sample = diff.reshape(len(x), -1).max(axis=1) if len(x) else np.zeros(0)
    result.max_abs_diff = float(diff.max()) if diff.size else 0.0
    result.mean_abs_diff = float(diff.mean()) if diff.size else 0.0
    result.worst_sample = int(per_sample.argmax()) if len(per_sample) else -1
    if result.max_abs_diff > tol:
        scale = float(np.abs(ref).max()) if ref.size else 0.0
        result.problems.append(
            f"outputs differ by up to {result.max_abs_diff:.3g} (largest torch output "
            f"magnitude {scale:.3g}): the ONNX file does not hold these weights -- compare with "
            "what it was exported from: --from ARTIFACT, or --arch/--checkpoint/--seed of the "
            "export"
        )
    result.ok = not result.problems
    return result
