"""A child process that scores the federation's global model on the server's validation data (FedAvg's).

The server stays torch-free: `ModelScorer` starts `python -m edge_agent.core.scorer` once (torch imported once,
the validation images normalised once) and asks it, each round, for the predictions of a parameter vector; the
child answers in one JSON line. A child that died or failed is said once in the log and the round goes unscored.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO

import numpy as np

from protofl.config import FederationConfig

log = logging.getLogger("protofl.server")


class ModelScorer:
    """`predict(params)`: the global model's class per validation image (None where the child cannot answer)."""

    def __init__(self, cfg: FederationConfig, x: np.ndarray, mean: list[float], std: list[float]) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="protofl-scorer-")
        d = Path(self._dir.name)
        (d / "config.json").write_text(json.dumps(cfg.to_dict()))
        np.savez(d / "val.npz", x=x, mean=np.asarray(mean), std=np.asarray(std))
        self._proc: subprocess.Popen[str] | None = subprocess.Popen(
            [sys.executable, "-m", "edge_agent.core.scorer", str(d / "config.json"), str(d / "val.npz")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def predict(self, params: np.ndarray) -> np.ndarray | None:
        proc = self._proc
        if proc is None:
            return None
        path = Path(self._dir.name) / "params.npy"
        np.save(path, np.asarray(params, np.float32), allow_pickle=False)
        try:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(f"{path}\n")
            proc.stdin.flush()
            answer = json.loads(proc.stdout.readline() or "null")
        except (OSError, ValueError) as exc:
            answer = {"error": str(exc)}
        if not isinstance(answer, dict) or "predictions" not in answer:
            why = answer.get("error") if isinstance(answer, dict) else _tail(proc.stderr)
            log.warning("the global model is no longer scored on the validation data: its scorer failed (%s)", why)
            self.close()
            return None
        return np.asarray(answer["predictions"], np.int64)

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.stdin is not None:
                proc.stdin.close()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._dir.cleanup()


def _tail(stream: IO[str] | None) -> str:
    if stream is None:
        return "no output"
    lines = stream.read().strip().splitlines()
    return lines[-1] if lines else "no output"
