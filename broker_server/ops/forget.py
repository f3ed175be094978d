"""Unlearn a device from a fleet's ended runs: `protofl-server devices revoke --forget ID` (issue 59, item 8).

A run with the ridge predictor (protofl/algorithms/ridge.py) solves its global head from sums of statistics each
device sent once. The server keeps each device's statistics where it keeps every accepted upload: the run's
journal (FLEET/runs/NAME/aggregator/journal-*.log, which the server never deletes), as the device sent them:
ridge_length(d, C) float32 values a device, (d+1)(d+2)/2 + (d+1)C (11 KB for d = 64 and 10 classes, 550 KB for
the default preset's d = 512). Forgetting a device reads them back, subtracts its vector from the sums of all
(`ridge.forget`) and solves the head again: the same float32 head as a federation that never had the device (the
float64 sums of float32 vectors are exact), written over the run's global predictor
(artifacts/global/predictor.npz, its manifest's `made_from` saying who was forgotten) and listed in the run's
`forgotten.json`, which a later forget reads so that the devices forgotten before stay out.

What it does not undo: anything but the ridge head. The device's prototypes and its model or adapter updates in the
run's other artifacts stay folded (the rounds do not fold again without it), the backbone its updates shaped stays
shaped by them, and the copies of the old head the devices kept (each device's artifacts, a predictor exported
before) keep the device. A run that is still running is not changed: its server writes its artifacts when it ends;
forget again then.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from broker_server.core.durable import journal_records
from broker_server.ops.fleet_run import RUNS, STATE
from protofl import artifacts as art
from protofl.algorithms.ridge import RidgeState, forget, ridge_head, ridge_length
from protofl.config import FederationConfig
from protofl.errors import ConfigError, ProtoFLError
from protofl.wire import ParamsUpload, decode_message

FORGOTTEN = "forgotten.json"  # in a run's state dir: the devices taken out of its global head, in order


@dataclass(frozen=True)
class Forgot:
    """A run whose head was solved again without `device`."""

    run: Path
    device: str
    devices: int  # the contributors left
    samples: int  # their samples

    def text(self) -> str:
        return (
            f"{self.device} forgotten in run '{self.run.name}': its global head solved again from "
            f"{self.devices} device(s), {self.samples} sample(s)"
        )


def run_dirs(state: Path) -> list[Path]:
    """The state dirs of a fleet's runs (FLEET/runs/*), or `state` itself (a `start --state-dir`)."""
    root = state / RUNS
    if root.is_dir():
        return sorted(p for p in root.iterdir() if not p.name.startswith(".") and (p / "aggregator").is_dir())
    return [state] if (state / "aggregator").is_dir() else []


def kept_statistics(run: Path, cfg: FederationConfig) -> dict[str, np.ndarray]:
    """Each device's ridge statistics as the run's server accepted them (its journal), in the order it folded
    them; a device's later (empty) parameter uploads add nothing, as they added nothing to the sums."""
    from broker_server.core.shell import decoder_limits

    limits = decoder_limits(cfg)
    n = ridge_length(int(cfg.proto_dim), int(cfg.num_classes))
    kept: dict[str, np.ndarray] = {}
    for rec in journal_records(run / "aggregator"):
        if rec.kind != ParamsUpload.KIND or rec.client in kept:
            continue
        msg = decode_message(rec.payload, limits=limits)[1]
        if isinstance(msg, ParamsUpload) and isinstance(msg.update, np.ndarray) and msg.update.shape == (n,):
            kept[rec.client] = np.asarray(msg.update, np.float32)
    return kept


def _forgotten(run: Path) -> list[str]:
    try:
        raw = json.loads((run / FORGOTTEN).read_text())
    except OSError:
        return []
    except ValueError as exc:
        raise ConfigError(f"{run / FORGOTTEN}: not a list of device ids ({exc})") from None
    if not isinstance(raw, list) or not all(isinstance(x, str) for x in raw):
        raise ConfigError(f"{run / FORGOTTEN}: not a list of device ids")
    return raw


def forget_in_run(run: Path, device: str) -> Forgot | None:
    """Solve run `run`'s global ridge head again without `device` (None: the run has no ridge head, or the device
    sent it no statistics, or it was forgotten there already)."""
    predictor = run / "artifacts" / art.GLOBAL / art.PREDICTOR
    manifest_path = run / "artifacts" / art.MANIFEST
    if not predictor.is_file() or not manifest_path.is_file():
        return None
    manifest = art.read_json(manifest_path)
    cfg = FederationConfig.from_dict(manifest["config"])
    if not cfg.options.get("ridge"):
        return None
    forgotten = _forgotten(run)
    kept = kept_statistics(run, cfg)
    if device not in kept or device in forgotten:
        return None
    dim, classes = int(cfg.proto_dim), int(cfg.num_classes)
    total = np.zeros(ridge_length(dim, classes))
    for vector in kept.values():  # in the order the server folded them: the sums it solved from
        total += vector
    samples = sum(int(round(float(v[ridge_length(dim, 0) - 1]))) for v in kept.values())
    state = RidgeState(total, sorted(kept), samples)
    for out in [*forgotten, device]:
        if out in state.contributors:
            state = forget(state, out, kept[out], dim, classes)
    if state.stats is None:
        raise ConfigError(
            f"run '{run.name}': {device} is the last device its global head was solved from; forgetting it leaves "
            f"no head (delete {predictor} instead)"
        )
    weight, bias = ridge_head(state.stats, dim, classes, float(cfg.ridge_lambda))
    _, _, backbone, info = art.read_predictor(predictor)
    gone = [*forgotten, device]
    info = {**info, "devices": len(state.contributors), "samples": state.samples, "forgotten": gone}
    art.write_predictor(predictor, weight, bias, backbone, info)
    made = manifest.get("predictor")
    if isinstance(made, dict) and isinstance(made.get("made_from"), dict):
        made["made_from"] = {**made["made_from"], **info}
        art.write_json(manifest_path, manifest)
    tmp = run / (FORGOTTEN + ".tmp")
    tmp.write_text(json.dumps(gone) + "\n")
    os.replace(tmp, run / FORGOTTEN)
    return Forgot(run, device, len(state.contributors), state.samples)


def forget_device(state: Path, device: str) -> tuple[list[Forgot], list[str]]:
    """Forget `device` in every ended run of fleet `state` (or in a `start --state-dir`): what was done, and the
    runs left as they are because they are still running (forget again once they end)."""
    done: list[Forgot] = []
    running: list[str] = []
    for run in run_dirs(state):
        try:
            if (run / STATE).read_text().strip() in ("running", "queued"):
                running.append(run.name)
                continue
        except OSError:
            pass
        try:
            forgot = forget_in_run(run, device)
        except (ProtoFLError, OSError, KeyError, ValueError) as exc:
            raise ConfigError(f"run '{run.name}': could not forget {device}: {exc}") from None
        if forgot is not None:
            done.append(forgot)
    return done, running
