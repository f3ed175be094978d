"""Latency and throughput of prototype extraction: torch vs onnxruntime fp32 vs onnxruntime int8.

Each backend is timed on its own (torch with ``inference_mode``; onnxruntime sessions created just
before their runs and dropped after) with the same intra-op thread count, after warm-up runs, and the
median of the timed runs is reported: on a shared machine the median is the figure least disturbed
by other processes.
"""

from __future__ import annotations

import functools
import gc
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from edge_agent.inference.onnx_export import graph_of
from edge_agent.inference.onnx_runtime import session
from edge_agent.training.models import ProtoNet

__all__ = ["BenchRow", "bench_model", "speedups", "time_call"]


@dataclass(frozen=True)
class BenchRow:
    backend: str  # "torch", "onnx-fp32", "onnx-int8"
    batch: int
    threads: int
    latency_ms: float  # median per batch
    throughput: float  # images per second at that median

    def as_dict(self) -> dict[str, object]:
        return {
            "backend": self.backend,
            "batch": self.batch,
            "threads": self.threads,
            "latency_ms": round(self.latency_ms, 3),
            "images_per_s": round(self.throughput, 1),
        }


def time_call(fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    """Median wall time of ``fn()`` in seconds, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(1, iters)):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_model(
    model: ProtoNet,
    onnx_models: dict[str, str | os.PathLike[str]],
    x: np.ndarray,
    batches: tuple[int, ...] = (1, 64),
    threads: int = 1,
    iters: int = 20,
    what: str = "features",
) -> list[BenchRow]:
    """Time ``model`` (torch) and each ``onnx_models[backend]`` on the first ``batch`` rows of ``x``.

    ``x`` needs at least max(batches) rows. torch's thread count is restored afterwards.
    """
    if len(x) < max(batches):
        raise ValueError(f"bench needs at least {max(batches)} input images, got {len(x)}")
    rows: list[BenchRow] = []
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model.eval()
        fn = graph_of(model, what)
        for b in batches:
            xb = torch.from_numpy(np.ascontiguousarray(x[:b], dtype=np.float32))
            with torch.inference_mode():
                sec = time_call(functools.partial(fn, xb), iters)
            rows.append(BenchRow("torch", b, threads, 1e3 * sec, b / sec))
    finally:
        torch.set_num_threads(before)
    for backend, path in onnx_models.items():
        sess = session(path, threads)
        name = sess.get_inputs()[0].name
        for b in batches:
            feed = {name: np.ascontiguousarray(x[:b], dtype=np.float32)}
            sec = time_call(functools.partial(sess.run, None, feed), iters)
            rows.append(BenchRow(backend, b, threads, 1e3 * sec, b / sec))
        del sess
        gc.collect()  # drop the session's thread pool before the next backend is timed
    return rows


def speedups(rows: list[BenchRow], baseline: str = "torch") -> dict[tuple[str, int], float]:
    """{(backend, batch): baseline latency / backend latency}."""
    base = {r.batch: r.latency_ms for r in rows if r.backend == baseline}
    return {
        (r.backend, r.batch): base[r.batch] / r.latency_ms for r in rows if r.backend != baseline and r.batch in base
    }
