"""onnxruntime on the device: a session for an exported graph, batched inference, the graph's metadata.

No torch here: ``protofl-edge predict`` runs on onnxruntime alone (plus ``onnx`` to read metadata), and
the ``onnx`` extractor and the frozen backbone run their exported graphs through the same session.
The export tool (``protofl-export``) builds on this module, never the other way round.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from protofl.errors import ConfigError

if TYPE_CHECKING:  # onnxruntime is optional at import time
    from onnxruntime import InferenceSession

__all__ = ["embed_onnx", "ort_refusals", "parse_floats", "read_metadata", "session"]


def session(path: str | os.PathLike[str] | bytes, threads: int | None = None, spin: bool = True) -> InferenceSession:
    """A CPU onnxruntime session; ``threads`` intra-op threads (None: onnxruntime's default).

    Every session of the project is built here (``predict``, ``verify``, the onnx extractor, the frozen backbone).
    ORT_ENABLE_ALL is what makes onnxruntime fast on these graphs: its layout transforms (NCHWc convolutions)
    are most of the gain over torch; the dynamo exporter, a fixed batch axis or flushing denormals gained nothing
    beyond noise (bench/results/ONNX.md, ``bench/bench_onnx.py --cpu-time``).

    ``spin=False`` stops idle worker threads from busy-waiting between runs: needed where many sessions
    share a few cores (a simulator's agents) or alternate with torch, at a small latency cost.
    """
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3  # errors only: ORT warns about unused initialisers in exported graphs
    if threads is not None:
        opts.intra_op_num_threads = int(threads)
        opts.inter_op_num_threads = 1
    if not spin:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    src = path if isinstance(path, bytes) else str(path)
    where = "the model" if isinstance(path, bytes) else str(path)
    with ort_refusals(f"onnxruntime cannot load {where}", "export it again with protofl-export onnx"):
        return ort.InferenceSession(src, opts, providers=["CPUExecutionProvider"])


@contextmanager
def ort_refusals(what: str, fix: str) -> Iterator[None]:
    """onnxruntime's own exceptions (Fail, InvalidGraph, InvalidArgument, ...: they derive from nothing but
    Exception) as one ConfigError that says `what` failed, onnxruntime's reason (its first line) and `fix`."""
    try:
        yield
    except Exception as exc:
        if not type(exc).__module__.startswith("onnxruntime"):
            raise
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"{what}: {type(exc).__name__}: {reason[:500]}; {fix}") from None


def embed_onnx(sess: InferenceSession, x: np.ndarray, batch_size: int = 256) -> np.ndarray:
    """Run ``sess`` over the rows of ``x`` in batches; float32 (n, out_dim)."""
    name = sess.get_inputs()[0].name
    x = np.ascontiguousarray(x, dtype=np.float32)
    with ort_refusals(
        f"onnxruntime refused to run the model on input of shape {tuple(x.shape[1:])}",
        "use the model exported for this data (its in_shape), or export it again with protofl-export onnx",
    ):
        out = [sess.run(None, {name: x[i : i + batch_size]})[0] for i in range(0, len(x), batch_size)]
    if not out:
        return np.zeros((0, int(sess.get_outputs()[0].shape[-1])), dtype=np.float32)
    return np.concatenate(out).astype(np.float32, copy=False)


def read_metadata(path: str | os.PathLike[str]) -> dict[str, str]:
    """The metadata_props of an ONNX file (without loading its weights into Python objects twice)."""
    import onnx

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"ONNX model {p} does not exist; create one with `protofl-export onnx --out {p}`")
    try:
        proto = onnx.load(str(p), load_external_data=False)
    except Exception as exc:  # noqa: BLE001 -- protobuf raises its own DecodeError for non-ONNX bytes
        raise ConfigError(
            f"{p} is not an ONNX model ({type(exc).__name__}: {exc}); export one with `protofl-export onnx`"
        ) from None
    return {e.key: e.value for e in proto.metadata_props}


def parse_floats(text: str | None) -> tuple[float, ...] | None:
    """'0.286,0.353' -> (0.286, 0.353) (metadata and CLI values)."""
    if not text:
        return None
    return tuple(float(v) for v in text.split(","))
