"""Deployable global-predictor routes side by side (issue 41, first measured step).

One federation -- Fashion-MNIST, Dirichlet(alpha) over N clients, the project's own partition
(`protofl.data.partition.build_federation`, after `limit_train`), so the clients' data and the server's
public set (20 images per class carved out of the training set, `public_per_class`) are exactly those of
`protofl-server simulate` for (N, alpha, seed, --train-limit) -- and on it every route below, with the same
client model (the project's `cnn`, or `--arch resnet18`), rounds R and local epochs E, each scored on the
official 10,000-image test set (its final-round accuracy; no route picks a round on the test set):

  fedavg          FedAvg's global model: the whole model (parameters and BatchNorm statistics) averaged,
                  weighted by |D_k|, every round. The baseline; its uplink is the bytes every ratio divides.
  public          CONTROL, public-only: the same model trained on the server's public set alone (SGD 0.01,
                  momentum 0.9, weight decay 1e-4, batch 64, 60 epochs; the issue measured 76.25 % for the cnn).
                  Its feature extractor (backbone, stem, adapter) is "the shared backbone" of the routes below:
                  shipped once, frozen.
  proto-l2        shared backbone + nearest global prototype (L2): each device sends its class means of the
  proto-cos       backbone's features and their counts once (FedProto's upload); the server's n-weighted global
                  prototypes (`protofl.algorithms.fedproto`); -cos: nearest by cosine. (FedNCM, Legate et al. 2023.)
  head            shared backbone + federated linear head: devices train the head on their frozen features with
                  cross-entropy, E epochs a round, FedAvg of the head only; starts from the public model's head.
                  (On frozen features a prototype-alignment term has no gradient in the head: it acts only with an
                  adapter, below.)
  head-ncm        the same, started from the global prototypes read as a linear classifier (w_c = g_c,
                  b_c = -|g_c|^2 / 2: the L2 nearest-prototype rule): FedNCM+FT (Legate et al., NeurIPS 2023).
  adapter-head    shared backbone + federated residual adapter and head (the project's rank-32 adapter):
                  cross-entropy + the project's MSE-scale prototype alignment (lambda 1) to last round's global
                  prototypes of z, which devices upload each round beside adapter and head (RefProtoFL-style).
  ridge           OWN ROUTE, Fed3R (Fani et al., ICML 2024, "Accelerating heterogeneous federated learning with
                  closed-form classifiers"): devices send once the sufficient statistics of a ridge regression on
                  their features, G_k = [h,1]^T [h,1] (upper triangle) and B_k = [h,1]^T onehot(y); the server
                  solves W = (sum G + lambda I)^-1 sum B in numpy (lambda = 1e-3 x mean diagonal of sum G): the
                  classifier a centralised ridge fit would give, whatever the label skew.
  head-ridge      the federated head started from the ridge classifier (Fed3R+FT, head only).
  distil-mean     ensemble distillation on the public set: each device fine-tunes its own copy of the public
  distil-counts   model on its data (plain cross-entropy, R x E epochs) and uploads once its class
                  probabilities on the public images (|public| x C values; -counts: and its C class counts); the
                  server averages them (-mean: uniformly, FedDF; -counts: each class's probability weighted by
                  the devices' shares of that class, n_kc / sum_j n_jc) and distils, in numpy, a head on the
                  frozen backbone's public-set features (`distil_head`); predictor = backbone + distilled head.
  topk-ef         OWN ROUTE, a reference from the compression literature (not a prototype federation): FedAvg of
                  the whole model with top-k sparsified updates and error feedback (Stich et al., NeurIPS 2018;
                  Sattler et al., "Sparse ternary compression", 2019, without the ternarisation): each device sends
                  the K = 0.4 % largest entries of (its update + its unsent residual) as indices and values
                  (ParamsUpload of a SparseVector: ~0.8 % of FedAvg's bytes), keeps the rest for the next round;
                  the server adds the |D_k|-weighted mean of the sparse updates. The bar a prototype route has to
                  beat: a deployable full model at <= 1/100 of FedAvg's bytes.
  local           CONTROL, local-only: each device trains its own model from FedAvg's initialisation on its own
                  data, R rounds of E epochs, no federation; its test accuracy, mean over devices.
  local-public    CONTROL: the distil routes' device models (public init, own data), mean over devices.
  ensemble-public REFERENCE, not deployable: those device models' mean class probabilities on the test set
                  (it needs every device's private model at serving time).

Issue 56 (PREDICTOR.md, "Full data"; run with --plateau-cap N, summarised by --fulldata-summary):
  fedavg-warm     REFERENCE: FedAvg started from the public-only model (the whole model, head included), run to
                  the plateau rule (`plateau_at`: the first round r >= 20 where the mean accuracy of the last 10
                  rounds gains under 0.2 points on the 10 before; scored every round, on --curve-test images),
                  at most --plateau-cap rounds; with --plateau-cap, `fedavg` runs to the same rule.
  refresh         g = shared backbone + ridge head solved from round 1's statistics; each later round every device
                  fine-tunes g (backbone + head, cross-entropy, the config optimiser, E epochs) and uploads the top-K
                  by magnitude of (g_local - g + e), e its error-feedback residual; the server adds the n-weighted
                  mean of the sparse updates; every T rounds (1 + T, 1 + 2T, ...) the devices also send the ridge
                  statistics of g's backbone (as received) and the head is re-solved from that round's sums.
                  K = 0.001 of g's floating state, T = 10 (the product's defaults; REFRESH_VARIANTS).
  refresh-k004    K = 0.004;  refresh-t0: T = 0 (the head never re-solved after round 1).
  refresh-erpa    + RefProtoFL's ERPA term lambda A(z, a_y), a_c the class means of g's z on the public set.
  refresh-frozen-head  (added after the first runs) the head frozen in local training (FedBABU-style): the top-K
                  goes to the backbone; the head changes only by the re-solve every T rounds.
  refresh-proto   + TinyProto/FedProto: lambda A(z, G_y), G_c the n-weighted mean of the devices' CPS-compressed
                  class prototypes (s = m/10 values a class) of the round before (sent every round, round 1 too).
  Bytes per round are recorded cumulatively (`uplink_curve`); refresh's downlink: the union of the sparse entries
  per round (`downlink_sparse_values`).

Bytes are uplink only (what devices send; the backbone and public set each device receives once are downlink),
counted as the project's encoded wire messages (`protofl.wire`: ParamsUpload of a dense vector for parameters,
ridge statistics and public-set probabilities -- the wire has no message of their own yet -- or of a SparseVector for
topk-ef; ProtoUpload with counts for prototypes), sized exactly without msgpack by `params_upload_bytes`,
`sparse_upload_bytes` and `proto_upload_bytes` (tests/bench/test_predictor_routes.py checks them against the
encoder). Per client per round = total / (N x R), so a one-shot upload is spread over the
R rounds the federation runs; ratio = total / FedAvg's total over the same R rounds.

SELECTION RULE (written before the runs; `select`):
  Candidates are the deployable global predictors: proto-l2, proto-cos, head, head-ncm, adapter-head, ridge,
  head-ridge, distil-mean, distil-counts, topk-ef. Each is compared paired by seed (bench/paired.py: mean of the
  per-seed differences, 95 % Student-t interval) on final-round test accuracy. A candidate QUALIFIES when
    (1) its uplink total is <= 1/100 of FedAvg's over the same rounds;
    (2) it is within 2 points of FedAvg or ahead: the interval of candidate - fedavg lies above -2;
    (3) it beats the public-only control: the interval of candidate - public lies above 0.
  The default is the qualifier with the highest mean accuracy, unless another qualifier that it does not beat
  (their paired interval reaches 0) uses fewer uplink bytes: then the one with the fewest bytes among those.
  If no candidate qualifies, the moonshot is missed in that setting; the report then names the best candidate
  that meets (1) and (3) (provisional default) and its gap to FedAvg. Below 2 seeds there is no interval: the
  verdict is a reading of the means (labelled so), never a decision.

    python -m bench.predictor_routes --out bench/results/predictor/A-cnn --seeds 0,1,2,3,4 --rounds 50
    python -m bench.predictor_routes --summary bench/results/predictor/A-cnn

Results: one JSON per (route, seed) in --out, written as soon as the route is done (iterative routes also leave
`<route>-s<seed>.partial.json` after every round); a rerun skips what exists. `--budget-s` stops starting work
that would not finish in time, and says what it skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import fcntl
import functools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.paired import paired

# --------------------------------------------------------------------------------------------------
# What is run and reported
# --------------------------------------------------------------------------------------------------

CANDIDATES = (
    "proto-l2",
    "proto-cos",
    "head",
    "head-ncm",
    "adapter-head",
    "ridge",
    "head-ridge",
    "distil-mean",
    "distil-counts",
    "topk-ef",
)
CONTROLS = ("public", "local", "local-public")
REFERENCES = ("fedavg", "ensemble-public", "fedavg-warm")
# issue 56: refresh and its variants, (K as a fraction of g's floating state, T, local objective)
REFRESH_VARIANTS: dict[str, tuple[float, int, str]] = {
    "refresh": (0.001, 10, "ce"),
    "refresh-k004": (0.004, 10, "ce"),
    "refresh-t0": (0.001, 0, "ce"),
    "refresh-erpa": (0.001, 10, "erpa"),
    "refresh-proto": (0.001, 10, "proto"),
    # added after the first CPU rounds (PREDICTOR.md "Full data": not in the rule written before the runs):
    # FedBABU-style, the head frozen in local training, so the top-K goes to the backbone; head by re-solve only
    "refresh-frozen-head": (0.001, 10, "ce-frozen-head"),
}
ROUTES = (
    "fedavg",
    "public",
    "proto-l2",
    "proto-cos",
    "ridge",
    "head",
    "head-ncm",
    "head-ridge",
    "adapter-head",
    "distil-mean",
    "distil-counts",
    "topk-ef",
    "local",
    "local-public",
    "ensemble-public",
    "fedavg-warm",
    *REFRESH_VARIANTS,
)
# A job computes one or several routes (they share the work); jobs run in this order (cheap ones first).
JOBS: dict[str, tuple[str, ...]] = {
    "public": ("public",),
    "proto": ("proto-l2", "proto-cos"),
    "ridge": ("ridge",),
    "head": ("head",),
    "head-ncm": ("head-ncm",),
    "head-ridge": ("head-ridge",),
    "adapter-head": ("adapter-head",),
    "fedavg": ("fedavg",),
    "topk-ef": ("topk-ef",),
    "distil": ("distil-mean", "distil-counts", "local-public", "ensemble-public"),
    "local": ("local",),
    "fedavg-warm": ("fedavg-warm",),
    **{v: (v,) for v in REFRESH_VARIANTS},
}
RATIO_MAX = 0.01  # rule (1)
WITHIN = 2.0  # rule (2), points
PUBLIC_EPOCHS = 60
PROTO_LAMBDA = 1.0  # adapter-head's alignment weight (the project's default, MSE scale)
RIDGE_LAMBDA = 1e-3  # relative to the mean diagonal of sum G
DISTIL_STEPS = 500
TOPK_RATIO = 0.004  # topk-ef: K = ceil(0.004 d) values a round (protofl.algorithms.apud.topk_budget's formula)
NCM_MARGIN = 4.0  # head-ncm's initial logit margin at the prototypes (ncm_head)
NUM_CLASSES = 10
IN_SHAPE = (1, 28, 28)
PROTO_DIM, ADAPTER_RANK = 512, 32  # the config defaults (m, r)
LR, MOMENTUM, WEIGHT_DECAY, BATCH = 0.01, 0.9, 1e-4, 64  # the config defaults
PUBLIC_PER_CLASS = 20
PLATEAU_WINDOW, PLATEAU_GAIN = 10, 0.2  # issue 56's plateau rule (plateau_at), points
CPS_S = PROTO_DIM // 10  # refresh-proto: CPS values a class (ALGORITHMS.md, TinyProto's default s = m/10)

NUMBERS = """numbers reported (per route and seed, one JSON each; --summary tabulates them):
  acc                global accuracy in %: the route's one predictor on the official test set (10,000 images
                     unless --test-limit), final round. local/local-public: mean over the devices' own models.
  curve              [round, acc] for iterative routes (every --test-every rounds and the last).
  uplink_total       bytes all clients send over the run (encoded wire messages; uplink only).
  uplink_per_client_round = uplink_total / (clients x rounds) (one-shot uploads spread over the R rounds).
  uplink_ratio       uplink_total / FedAvg's uplink_total over the same rounds (rule: <= 1/100).
  fedavg converged_at  the first round r >= 6 where FedAvg's accuracy gained < 0.2 points over 5 rounds
                     (acc(r) - acc(r-5) < 0.2, the issue's stopping rule; needs --test-every 1), or null.
  wall_s             seconds the route (its job) took in this process.
--summary: mean +- std over seeds, paired differences to FedAvg and to the public-only control with their 95 %
  Student-t intervals (bench/paired.py), and the selection rule's verdict (see the module docstring)."""


def log(msg: str) -> None:
    t = time.time()
    print(f"[{time.strftime('%H:%M:%S', time.localtime(t))} +{t - _T0:7.1f}s] {msg}", flush=True)


_T0 = time.time()
_T0_MONO = time.monotonic()  # --budget-s counts from here (the module's import, before data and device start)

# --------------------------------------------------------------------------------------------------
# Byte accounting: the encoded size of the project's wire messages (protofl.wire), without msgpack
# --------------------------------------------------------------------------------------------------


class Blob:
    """A msgpack bin of `n` bytes, sized without holding them."""

    def __init__(self, n: int) -> None:
        self.n = int(n)

    def __len__(self) -> int:
        return self.n


def msgpack_size(obj: Any) -> int:
    """Bytes msgpack (use_bin_type=True, doubles for floats) writes for `obj` (non-negative ints only)."""
    if obj is None or isinstance(obj, bool):
        return 1
    if isinstance(obj, int):
        if obj < 0:
            raise ValueError("negative ints are not sized here")
        return 1 if obj < 128 else 2 if obj < 256 else 3 if obj < 65536 else 5 if obj < 2**32 else 9
    if isinstance(obj, float):
        return 9
    if isinstance(obj, str):
        n = len(obj.encode())
        return n + (1 if n < 32 else 2 if n < 256 else 3 if n < 65536 else 5)
    if isinstance(obj, (bytes, Blob)):
        n = len(obj)
        return n + (2 if n < 256 else 3 if n < 65536 else 5)
    if isinstance(obj, (list, tuple)):
        n = len(obj)
        return (1 if n < 16 else 3 if n < 65536 else 5) + sum(msgpack_size(v) for v in obj)
    if isinstance(obj, dict):
        n = len(obj)
        return (1 if n < 16 else 3 if n < 65536 else 5) + sum(msgpack_size(k) + msgpack_size(v) for k, v in obj.items())
    raise TypeError(f"cannot size {type(obj).__name__}")


_ITEM = {"f4": 4, "f2": 2, "u1": 1, "u2": 2, "u4": 4}


def _array(dt: str, shape: Sequence[int]) -> dict:
    return {"dt": dt, "sh": [int(s) for s in shape], "b": Blob(math.prod(shape) * _ITEM[dt])}


def _envelope(kind: str, body: dict, round_: int, sender: str) -> dict:
    # protofl.wire.codec.ENVELOPE_KEYS; msg_id: 16 hex characters (encode_message's uuid4().hex[:16])
    return {
        "v": 1,
        "kind": kind,
        "fed": "sim",
        "round": round_,
        "phase": "train",
        "sender": sender,
        "msg_id": "0" * 16,
        "body": body,
    }


def params_upload_bytes(
    n_values: int, n_samples: int, round_: int = 1, dt: str = "f4", sender: str = "client-000"
) -> int:
    """Encoded bytes of a ParamsUpload carrying a dense vector of `n_values` (protofl.wire.ParamsUpload)."""
    body = {"update": _array(dt, [n_values]), "n_samples": int(n_samples), "base_round": int(round_)}
    return msgpack_size(_envelope("adapter", body, round_, sender))


def sparse_upload_bytes(n: int, k: int, n_samples: int, round_: int = 1, sender: str = "client-000") -> int:
    """Encoded bytes of a ParamsUpload carrying a SparseVector of length `n` with `k` f4 values: positions as
    indices (u2 below 2^16, else u4) or as a packed bit mask, whichever is smaller (`protofl.wire.encode_sparse`)."""
    values = _array("f4", [k])
    by_index = {"n": int(n), "i": _array("u2" if n < 2**16 else "u4", [k]), "v": values}
    by_mask = {"n": int(n), "mask": _array("u1", [(n + 7) // 8]), "v": values}
    update = by_index if msgpack_size(by_index) <= msgpack_size(by_mask) else by_mask
    body = {"update": update, "n_samples": int(n_samples), "base_round": int(round_)}
    return msgpack_size(_envelope("adapter", body, round_, sender))


def topk_count(d: int, ratio: float = TOPK_RATIO) -> int:
    """K = ceil(ratio x d) clipped to [1, d] (`protofl.algorithms.apud.topk_budget`, tested equal)."""
    return max(1, min(int(d), math.ceil(round(ratio * int(d), 6))))


def proto_upload_bytes(
    n_classes: int, dim: int, n_samples: int, round_: int = 1, counts: bool = True, sender: str = "client-000"
) -> int:
    """Encoded bytes of a ProtoUpload with `n_classes` local prototypes of width `dim` (and their counts)."""
    local = {
        "c": _array("u2", [n_classes]),
        "v": _array("f4", [n_classes, dim]),
        "n": _array("u4", [n_classes]) if counts else None,
    }
    body = {"local": local, "public": None, "n_samples": int(n_samples)}
    return msgpack_size(_envelope("protos", body, round_, sender))


def ridge_values(dim: int, num_classes: int) -> int:
    """Values of one ridge upload: the upper triangle of G ((d+1) x (d+1), bias column added) and B ((d+1) x C)."""
    d = dim + 1
    return d * (d + 1) // 2 + d * num_classes


def route_uplink(
    route: str,
    *,
    sizes: Sequence[int],
    classes_held: Sequence[int],
    rounds: int,
    full_params: int,
    dim: int,
    head_params: int,
    adapter_params: int,
    public_n: int,
    num_classes: int = NUM_CLASSES,
) -> int:
    """Uplink bytes over the whole run, all clients, for `route` (0 for controls)."""
    total = 0
    for k, (n, held) in enumerate(zip(sizes, classes_held, strict=True)):
        sender = f"client-{k:03d}"
        proto = proto_upload_bytes(held, dim, n, 1, sender=sender)
        ridge = params_upload_bytes(ridge_values(dim, num_classes), n, 1, sender=sender)
        heads = sum(params_upload_bytes(head_params, n, r, sender=sender) for r in range(1, rounds + 1))
        if route in ("fedavg", "fedavg-warm"):
            total += sum(params_upload_bytes(full_params, n, r, sender=sender) for r in range(1, rounds + 1))
        elif route in REFRESH_VARIANTS:
            total += refresh_client_uplink(route, n, held, rounds, full_params, dim, num_classes, sender)
        elif route == "topk-ef":
            total += sum(
                sparse_upload_bytes(full_params, topk_count(full_params), n, r, sender=sender)
                for r in range(1, rounds + 1)
            )
        elif route in ("proto-l2", "proto-cos"):
            total += proto
        elif route == "ridge":
            total += ridge
        elif route == "head":
            total += heads
        elif route == "head-ncm":
            total += proto + heads
        elif route == "head-ridge":
            total += ridge + heads
        elif route == "adapter-head":
            total += sum(
                params_upload_bytes(adapter_params + head_params, n, r, sender=sender)
                + proto_upload_bytes(held, dim, n, r, sender=sender)
                for r in range(1, rounds + 1)
            )
        elif route == "distil-mean":
            total += params_upload_bytes(public_n * num_classes, n, rounds, sender=sender)
        elif route == "distil-counts":
            total += params_upload_bytes(public_n * num_classes + num_classes, n, rounds, sender=sender)
        elif route in CONTROLS or route == "ensemble-public":
            return 0
        else:
            raise ValueError(f"unknown route {route!r}")
    return total


def refresh_client_uplink(
    route: str, n: int, held: int, rounds: int, full_params: int, dim: int, num_classes: int, sender: str
) -> int:
    """One device's uplink over `rounds` rounds of a refresh variant: round 1 its ridge statistics of the shared
    backbone; rounds 2..R a SparseVector of K = topk_count(d, ratio) values; in every re-solve round (1 + jT) the
    ridge statistics again; refresh-proto: its CPS-compressed prototypes (s values a class, with counts) every
    round, round 1 included."""
    ratio, period, objective = REFRESH_VARIANTS[route]
    k = topk_count(full_params, ratio)
    ridge = ridge_values(dim, num_classes)
    total = 0
    for r in range(1, rounds + 1):
        if r == 1 or (period > 0 and (r - 1) % period == 0):
            total += params_upload_bytes(ridge, n, r, sender=sender)
        if r > 1:
            total += sparse_upload_bytes(full_params, k, n, r, sender=sender)
        if objective == "proto":
            total += proto_upload_bytes(held, CPS_S, n, r, sender=sender)
    return total


def plateau_at(
    curve: Sequence[Sequence[float]], window: int = PLATEAU_WINDOW, gain: float = PLATEAU_GAIN
) -> int | None:
    """Issue 56's plateau rule on a per-round curve [(round, acc)]: the first round r >= 2 x window at which the
    mean accuracy of rounds r-window+1..r gains under `gain` points on the mean of the `window` rounds before
    (None if it never fires; rounds missing from the curve are never judged)."""
    acc = {int(r): float(a) for r, a in curve}
    for r in sorted(acc):
        if r < 2 * window:
            continue
        last = [acc.get(i) for i in range(r - window + 1, r + 1)]
        before = [acc.get(i) for i in range(r - 2 * window + 1, r - window + 1)]
        if any(v is None for v in last + before):
            continue
        if statistics.fmean(last) - statistics.fmean(before) < gain:  # type: ignore[arg-type]
            return r
    return None


def topk_ef_step(
    gvec: Any, locals_: Sequence[Any], residuals: list[Any], weights: Sequence[float], k: int
) -> tuple[Any, list[Any]]:
    """One round of top-K with error feedback (torch tensors): device j sends the k entries of largest
    magnitude of u_j = (locals_[j] - gvec) + residuals[j] (residual None = 0) and keeps e_j = u_j - sent_j;
    the server adds sum_j weights[j] sent_j (the n-weighted mean: weights sum to 1). Returns (new gvec, the
    new residuals); `residuals` is updated in place too."""
    import torch

    acc = torch.zeros_like(gvec)
    for j, (w_local, wt) in enumerate(zip(locals_, weights, strict=True)):
        sent, residuals[j] = topk_ef_send(w_local - gvec, residuals[j], k)
        acc.add_(sent, alpha=float(wt))
    return gvec + acc, residuals


def topk_ef_send(delta: Any, residual: Any, k: int) -> tuple[Any, Any]:
    """A device's top-K with error feedback (torch): u = delta + residual; returns (sent: u on its k entries of
    largest magnitude, zeros elsewhere; the new residual u - sent)."""
    import torch

    u = delta if residual is None else delta + residual
    idx = torch.topk(u.abs(), k, sorted=False).indices
    sent = torch.zeros_like(u)
    sent[idx] = u[idx]
    return sent, u - sent


# --------------------------------------------------------------------------------------------------
# Server side, numpy only (what a torch-free server computes)
# --------------------------------------------------------------------------------------------------


def _project_protos() -> tuple[Callable, Callable, Any] | None:
    try:  # the project's prototype math (needs msgpack through protofl.technique -> protofl.wire)
        from protofl.algorithms.fedproto import PrototypeAggregator
        from protofl.algorithms.prototypes import local_prototypes, nearest_prototype
    except ImportError:
        return None
    return local_prototypes, nearest_prototype, PrototypeAggregator


def class_means(z: np.ndarray, y: np.ndarray, num_classes: int) -> tuple[dict[int, np.ndarray], dict[int, int]]:
    """A device's prototype upload: per-class means of its features and the counts (FedProto's local prototypes;
    `protofl.algorithms.fedproto.local_prototypes` where it imports, else the same math here)."""
    proj = _project_protos()
    if proj is not None:
        return proj[0](z, y, num_classes)
    counts = np.bincount(y, minlength=num_classes)
    sums = np.zeros((num_classes, z.shape[1]), np.float64)
    np.add.at(sums, y, z.astype(np.float64))
    present = np.flatnonzero(counts)
    return (
        {int(c): (sums[c] / counts[c]).astype(np.float32) for c in present},
        {int(c): int(counts[c]) for c in present},
    )


def global_prototypes(
    uploads: Sequence[tuple[dict[int, np.ndarray], dict[int, int]]], num_classes: int, dim: int
) -> dict[int, np.ndarray]:
    """The server's n-weighted global prototypes g_c = sum_k n_kc p_kc / sum_k n_kc over the devices that sent c."""
    proj = _project_protos()
    if proj is not None:
        agg = proj[2](num_classes, dim, "weighted")
        for protos, counts in uploads:
            agg.add(protos, counts)
        return agg.result()
    s = np.zeros((num_classes, dim), np.float64)
    w = np.zeros(num_classes, np.float64)
    for protos, counts in uploads:
        for c, p in protos.items():
            s[c] += counts[c] * np.asarray(p, np.float64)
            w[c] += counts[c]
    return {int(c): (s[c] / w[c]).astype(np.float32) for c in np.flatnonzero(w > 0)}


def nearest_l2(z: np.ndarray, protos: dict[int, np.ndarray]) -> np.ndarray:
    """Class of the nearest (L2) global prototype per row of z; ties to the lower class id."""
    proj = _project_protos()
    if proj is not None:
        return proj[1](z, protos)
    classes = np.array(sorted(protos))
    table = np.stack([np.asarray(protos[c], np.float64) for c in classes])
    d2 = (table * table).sum(1)[None, :] - 2.0 * (z.astype(np.float64) @ table.T)
    return classes[np.argmin(d2, axis=1)]


def nearest_cos(z: np.ndarray, protos: dict[int, np.ndarray]) -> np.ndarray:
    """Class of the global prototype with the highest cosine to each row of z; ties to the lower class id."""
    classes = np.array(sorted(protos))
    table = np.stack([np.asarray(protos[c], np.float64) for c in classes])
    table /= np.maximum(np.linalg.norm(table, axis=1, keepdims=True), 1e-12)
    zz = z.astype(np.float64)
    zz = zz / np.maximum(np.linalg.norm(zz, axis=1, keepdims=True), 1e-12)
    return classes[np.argmax(zz @ table.T, axis=1)]


def ncm_head(
    protos: dict[int, np.ndarray], num_classes: int, dim: int, margin: float = NCM_MARGIN
) -> tuple[np.ndarray, np.ndarray]:
    """The L2 nearest-prototype rule as a linear head: w_c = g_c / T, b_c = -|g_c|^2 / (2 T), whose argmax is
    the nearest prototype for any T > 0. T = mean over class pairs of |g_c - g_c'|^2 / (2 margin), so that a
    feature at a prototype leads the other classes by `margin` logits on average (unscaled, the logits of
    features with norms in the tens saturate the softmax and cross-entropy fine-tuning barely moves).
    A class with no prototype gets w = 0, b = -1e4 (never chosen while another class has one)."""
    classes = sorted(protos)
    g = np.stack([np.asarray(protos[c], np.float64) for c in classes])
    d2 = ((g[:, None, :] - g[None, :, :]) ** 2).sum(-1)
    pairs = d2[~np.eye(len(classes), dtype=bool)]
    temp = float(pairs.mean()) / (2 * margin) if pairs.size and pairs.mean() > 0 else 1.0
    w = np.zeros((num_classes, dim), np.float32)
    b = np.full(num_classes, -1e4, np.float32)
    for i, c in enumerate(classes):
        w[c] = g[i] / temp
        b[c] = -0.5 * float(g[i] @ g[i]) / temp
    return w, b


def ridge_stats(h: np.ndarray, y: np.ndarray, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """A device's ridge upload (Fed3R): G = [h,1]^T [h,1] and B = [h,1]^T onehot(y), float64."""
    ha = np.hstack([h.astype(np.float64), np.ones((h.shape[0], 1))])
    onehot = np.zeros((h.shape[0], num_classes))
    onehot[np.arange(h.shape[0]), y] = 1.0
    return ha.T @ ha, ha.T @ onehot


def ridge_solve(g: np.ndarray, b: np.ndarray, lam_rel: float = RIDGE_LAMBDA) -> tuple[np.ndarray, np.ndarray]:
    """The server's closed-form classifier from the summed statistics: theta = (G + lam I)^-1 B with
    lam = lam_rel x mean diagonal of G; returns the head (W (C, d), b (C,))."""
    d = g.shape[0]
    lam = lam_rel * float(np.trace(g)) / d
    theta = np.linalg.solve(g + lam * np.eye(d), b)
    return theta[:-1].T.astype(np.float32), theta[-1].astype(np.float32)


def ensemble_targets(probs: np.ndarray, counts: np.ndarray | None = None) -> np.ndarray:
    """The server's distillation targets from devices' class probabilities on the public set.

    probs (K, n, C); counts None: the uniform mean over devices (FedDF); counts (K, C) (n_kc): each class's
    probability averaged with weights n_kc / sum_j n_jc (uniform for a class nobody holds), then each row
    renormalised to sum to 1."""
    p = np.asarray(probs, np.float64)
    if counts is None:
        return p.mean(axis=0)
    n = np.asarray(counts, np.float64)
    tot = n.sum(axis=0, keepdims=True)
    w = np.where(tot > 0, n / np.where(tot > 0, tot, 1.0), 1.0 / n.shape[0])  # (K, C)
    t = np.einsum("kc,knc->nc", w, p)
    return t / t.sum(axis=1, keepdims=True)


def _softmax(a: np.ndarray) -> np.ndarray:
    a = a - a.max(axis=1, keepdims=True)
    e = np.exp(a)
    return e / e.sum(axis=1, keepdims=True)


def distil_head(
    phi: np.ndarray,
    targets: np.ndarray,
    w0: np.ndarray,
    b0: np.ndarray,
    steps: int = DISTIL_STEPS,
    weight_decay: float = WEIGHT_DECAY,
    lr: float | None = None,
    nesterov: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Server-side ensemble distillation, numpy only: the head (W (C, m), b (C,)) on the frozen backbone's
    public-set features phi (n, m) minimising mean_x CE(targets(x), softmax(W phi(x) + b)) + wd/2 |W|^2
    (= the KL to the targets up to a constant), by `steps` full-batch gradient steps from (w0, b0).

    Step size 1/L with L = |[phi, 1]|_2^2 / (2 n) + wd (softmax cross-entropy's Hessian in the logits is at
    most 1/2), unless `lr` is given; Nesterov's momentum (t-1)/(t+2) unless `nesterov` is False."""
    x = np.hstack([phi.astype(np.float64), np.ones((phi.shape[0], 1))])
    t = np.asarray(targets, np.float64)
    n = x.shape[0]
    theta = np.vstack([np.asarray(w0, np.float64).T, np.asarray(b0, np.float64)[None, :]])  # (m+1, C)
    decay = np.ones((theta.shape[0], 1))
    decay[-1] = 0.0  # no decay on the bias
    if lr is None:
        lr = 1.0 / (np.linalg.norm(x, 2) ** 2 / (2 * n) + weight_decay)
    prev = theta.copy()
    for i in range(1, steps + 1):
        y = theta + ((i - 2) / (i + 1)) * (theta - prev) if nesterov and i > 1 else theta
        grad = x.T @ (_softmax(x @ y) - t) / n + weight_decay * decay * y
        prev, theta = theta, y - lr * grad
    return theta[:-1].T.astype(np.float32), theta[-1].astype(np.float32)


def head_predict(h: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.argmax(h.astype(np.float64) @ w.T.astype(np.float64) + b, axis=1)


# --------------------------------------------------------------------------------------------------
# The selection rule on result rows
# --------------------------------------------------------------------------------------------------


def route_stats(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per route: acc by seed, bytes (mean over seeds), kind."""
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        if not r.get("complete", True):
            continue
        s = out.setdefault(r["route"], {"acc": {}, "uplink": [], "ratio": [], "per_client_round": []})
        s["acc"][int(r["seed"])] = float(r["acc"])
        s["uplink"].append(float(r.get("uplink_total", 0)))
        if r.get("uplink_ratio") is not None:
            s["ratio"].append(float(r["uplink_ratio"]))
        s["per_client_round"].append(float(r.get("uplink_per_client_round", 0)))
    for s in out.values():
        s["uplink_mean"] = statistics.fmean(s["uplink"]) if s["uplink"] else 0.0
        s["ratio_mean"] = statistics.fmean(s["ratio"]) if s["ratio"] else None
    return out


def select(rows: Sequence[dict[str, Any]], ratio_max: float = RATIO_MAX, within: float = WITHIN) -> dict[str, Any]:
    """Apply the selection rule (module docstring) to result rows ({route, seed, acc, uplink_total, uplink_ratio}).

    Returns {"checks": {route: {...}}, "default": route or None, "provisional": route or None, "decided": bool,
    "why": text}."""
    st = route_stats(rows)
    if "fedavg" not in st or "public" not in st:
        return {
            "checks": {},
            "default": None,
            "provisional": None,
            "decided": False,
            "why": "FedAvg's and the public-only control's rows are needed",
        }
    checks: dict[str, dict[str, Any]] = {}
    for route in CANDIDATES:
        if route not in st:
            continue
        acc = st[route]["acc"]
        vs_f = paired(acc, st["fedavg"]["acc"])
        vs_p = paired(acc, st["public"]["acc"])
        ratio = st[route]["ratio_mean"]
        iv_f, iv_p = vs_f.interval, vs_p.interval
        c = {
            "mean": statistics.fmean(acc.values()),
            "seeds": sorted(acc),
            "bytes": st[route]["uplink_mean"],
            "ratio": ratio,
            "vs_fedavg": vs_f,
            "vs_public": vs_p,
            "bytes_ok": ratio is not None and ratio <= ratio_max,
            # below 2 seeds: the means alone (a reading, not a decision)
            "near_fedavg": (iv_f[0] > -within) if iv_f is not None else (vs_f.mean is not None and vs_f.mean > -within),
            "beats_public": (iv_p[0] > 0) if iv_p is not None else (vs_p.mean is not None and vs_p.mean > 0),
            "intervals": iv_f is not None and iv_p is not None,
        }
        c["qualifies"] = c["bytes_ok"] and c["near_fedavg"] and c["beats_public"]
        checks[route] = c
    decided = bool(checks) and all(c["intervals"] for c in checks.values())
    qual = [r for r, c in checks.items() if c["qualifies"]]
    out: dict[str, Any] = {"checks": checks, "default": None, "provisional": None, "decided": decided}
    if qual:
        best = max(qual, key=lambda r: checks[r]["mean"])
        if decided:  # the qualifiers the best does not beat (paired interval reaching 0) tie with it
            tied = [r for r in qual if r == best or paired(st[best]["acc"], st[r]["acc"]).beats() != 1]
        else:  # below 2 seeds no tie can be judged: the best mean
            tied = [best]
        default = min(tied, key=lambda r: (checks[r]["bytes"], -checks[r]["mean"]))
        out["default"] = default
        out["why"] = (
            f"{default} qualifies (best by mean: {best}; not beaten by it and fewest bytes among: "
            f"{', '.join(sorted(tied))})"
            if default != best
            else f"{default} qualifies with the highest mean"
        )
        if not decided:
            out["why"] += " -- one-seed reading of the means, not a decision"
        return out
    fall = [r for r, c in checks.items() if c["bytes_ok"] and c["beats_public"]]
    if fall:
        prov = max(fall, key=lambda r: checks[r]["mean"])
        out["provisional"] = prov
        out["why"] = (
            f"no candidate qualifies: moonshot missed here; provisional default {prov} "
            f"(meets the byte bound and beats the public-only control), "
            f"{prov} - fedavg = {checks[prov]['vs_fedavg'].text()}"
        )
    else:
        out["why"] = "no candidate qualifies, and none meets the byte bound while beating the public-only control"
    if not decided:
        out["why"] += " -- one-seed reading of the means, not a decision"
    return out


# --------------------------------------------------------------------------------------------------
# Data (the project's recipe)
# --------------------------------------------------------------------------------------------------


def limit_train_idx(n: int, limit: int | None, seed: int) -> np.ndarray:
    """The indices `protofl.data.federation.limit_train` keeps (the same draw; tested equal to it)."""
    if limit is None or limit >= n:
        return np.arange(n)
    return np.sort(np.random.default_rng([seed, 0x5EB]).permutation(n)[:limit])


def federation(train_y: np.ndarray, clients: int, alpha: float, seed: int) -> Any:
    """`protofl.data.federation.federation_split` with the config defaults (public_per_class 20, every class,
    batch 64): the partition every preset's simulation of (N, alpha, seed) uses."""
    from protofl.data.partition import build_federation

    return build_federation(
        train_y, clients, alpha, seed, public_per_class=PUBLIC_PER_CLASS, public_classes=None, batch_size=BATCH
    )


# --------------------------------------------------------------------------------------------------
# Device side (torch)
# --------------------------------------------------------------------------------------------------


class BudgetStop(Exception):
    pass


class Budget:
    def __init__(self, seconds: float | None, start: float | None = None) -> None:
        self.seconds = seconds
        self.t0 = time.monotonic() if start is None else start

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return math.inf if self.seconds is None else self.seconds - self.elapsed()

    def check(self) -> None:
        if self.left() <= 0:
            raise BudgetStop("--budget-s ran out mid-job")

    def check_pace(self, started: float, done: int, total: int, yield_late: bool) -> None:
        """With --yield-late: stop a job as soon as its pace so far (from its 2nd unit of `total` on) says it
        cannot finish within the budget, so that it leaves the GPU to the jobs that can."""
        if not yield_late or done < 2 or done >= total:
            return
        need = (time.monotonic() - started) / done * (total - done)
        if need > self.left():
            raise BudgetStop(
                f"--yield-late: {done} of {total} done; the rest needs ~{need:.0f} s, {self.left():.0f} s left"
            )


class Runner:
    """One process's runs: the data on the device, the shared public models, the jobs."""

    def __init__(self, a: argparse.Namespace) -> None:
        import torch

        from protofl.data.loaders import load_fashion_mnist

        self.torch = torch
        self.a = a
        dev = a.device
        if dev == "auto":
            dev = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(dev)
        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = True
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        if a.threads:
            torch.set_num_threads(a.threads)
        self.eval_bs = a.eval_batch or (
            4096 if self.device.type == "cuda" and a.arch == "cnn" else 1024 if self.device.type == "cuda" else 500
        )
        self.budget = Budget(a.budget_s, start=_T0_MONO)
        self.out: Path = a.out
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "cache").mkdir(exist_ok=True)
        t = time.monotonic()
        self.train_full, test = load_fashion_mnist(a.data_dir)
        if a.test_limit is not None:
            test = test.subset(np.arange(min(a.test_limit, len(test))))
        self.test_x = self._tensor(test.normalized())
        self.test_y = torch.from_numpy(test.y).to(self.device)
        self.test_y_np = test.y
        n_curve = min(a.curve_test or len(test), len(test))
        self.curve_x, self.curve_y = self.test_x[:n_curve], self.test_y[:n_curve]
        log(
            f"data: {len(self.train_full)} train, {len(test)} test images loaded in {time.monotonic() - t:.1f} s; "
            f"device {self.device}"
            + (f" ({torch.cuda.get_device_name(self.device)})" if self.device.type == "cuda" else "")
        )
        self.step_s: float | None = None  # seconds per training step of the full model (measured)
        self.head_step_s: float | None = None  # ... of a head on features
        self.durations: dict[str, float] = {}
        self.skipped: list[str] = []

    # -- helpers -------------------------------------------------------------------------------------
    def _tensor(self, x: np.ndarray) -> Any:
        return self.torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(self.device)

    def setting(self) -> dict[str, Any]:
        a = self.a
        return {
            "dataset": "fashion-mnist",
            "arch": a.arch,
            "clients": a.clients,
            "alpha": a.alpha,
            "rounds": a.rounds,
            "local_epochs": a.local_epochs,
            "train_limit": a.train_limit,
            "test_images": int(len(self.test_y_np)),
            "public_per_class": PUBLIC_PER_CLASS,
            "batch": BATCH,
            "lr": LR,
            "momentum": MOMENTUM,
            "weight_decay": WEIGHT_DECAY,
            "public_epochs": a.public_epochs,
            **({"plateau_cap": a.plateau_cap} if a.plateau_cap else {}),
            **({"curve_test": a.curve_test} if a.curve_test else {}),
        }

    def model(self, seed: int) -> Any:
        from edge_agent.training.models import build_model

        return build_model(self.a.arch, IN_SHAPE, NUM_CLASSES, PROTO_DIM, ADAPTER_RANK, seed=seed).to(self.device)

    def prepare(self, seed: int) -> dict[str, Any]:
        """The seed's federation on the device: each client's training data, the public set."""
        torch = self.torch
        keep = limit_train_idx(len(self.train_full), self.a.train_limit, seed)
        train = self.train_full.subset(keep)
        split = federation(train.y, self.a.clients, self.a.alpha, seed)
        x = train.normalized()
        cl = []
        for c in split.clients:
            cl.append(
                {
                    "x": self._tensor(x[c.train]),
                    "y": torch.from_numpy(train.y[c.train]).to(self.device),
                    "y_np": train.y[c.train],
                    "n": int(len(c.train)),
                }
            )
        pub = split.public
        d = {
            "seed": seed,
            "clients": cl,
            "pub_x": self._tensor(x[pub]),
            "pub_y": torch.from_numpy(train.y[pub]).to(self.device),
            "pub_y_np": train.y[pub],
            "sizes": [c["n"] for c in cl],
            "held": [int((np.bincount(c["y_np"], minlength=NUM_CLASSES) > 0).sum()) for c in cl],
            "counts": np.stack([np.bincount(c["y_np"], minlength=NUM_CLASSES) for c in cl]),
        }
        log(f"seed {seed}: {len(cl)} clients, sizes {d['sizes']}, classes held {d['held']}, public {len(pub)}")
        return d

    def sgd(
        self, params: Sequence[Any], loss_of: Callable[[Any], Any], n: int, epochs: int, rng: np.random.Generator
    ) -> tuple[Any, int]:
        """`epochs` epochs of SGD (lr 0.01, momentum 0.9, wd 1e-4, batch 64; a fresh optimiser, as the project's
        devices each round); batches of < 2 skipped (BatchNorm). No host sync per step."""
        torch = self.torch
        opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY, foreach=True)
        total = torch.zeros((), device=self.device)
        steps = 0
        for _ in range(epochs):
            perm = torch.from_numpy(rng.permutation(n)).to(self.device)
            for i in range(0, n, BATCH):
                idx = perm[i : i + BATCH]
                if idx.numel() < 2:
                    continue
                loss = loss_of(idx)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                total += loss.detach()
                steps += 1
        return total, steps

    def accuracy(self, fn: Callable[[Any], Any], x: Any, y: Any) -> float:
        torch = self.torch
        correct = torch.zeros((), dtype=torch.int64, device=self.device)
        with torch.no_grad():
            for i in range(0, int(x.shape[0]), self.eval_bs):
                correct += (fn(x[i : i + self.eval_bs]).argmax(1) == y[i : i + self.eval_bs]).sum()
        return 100.0 * int(correct.item()) / max(int(x.shape[0]), 1)

    def features(self, model: Any, x: Any) -> Any:
        torch = self.torch
        model.eval()
        with torch.no_grad():
            return torch.cat([model.features(x[i : i + self.eval_bs]) for i in range(0, int(x.shape[0]), self.eval_bs)])

    def full_params(self, model: Any) -> int:
        return sum(t.numel() for t in model.state_dict().values() if t.is_floating_point())

    # -- results ---------------------------------------------------------------------------------------
    def path(self, route: str, seed: int, partial: bool = False) -> Path:
        return self.out / f"{route}-s{seed}{'.partial' if partial else ''}.json"

    def done(self, route: str, seed: int) -> bool:
        p = self.path(route, seed)
        if not p.exists():
            return False
        rec = json.loads(p.read_text())
        if rec.get("setting") != self.setting():
            raise SystemExit(f"{p} was made with another setting ({rec.get('setting')}); use another --out")
        return bool(rec.get("complete", True))

    def uplink(self, route: str, sd: dict[str, Any], rounds: int) -> int:
        return route_uplink(
            route,
            sizes=sd["sizes"],
            classes_held=sd["held"],
            rounds=rounds,
            full_params=sd["full_params"],
            dim=PROTO_DIM,
            head_params=PROTO_DIM * NUM_CLASSES + NUM_CLASSES,
            adapter_params=sd["adapter_params"],
            public_n=int(sd["pub_x"].shape[0]),
        )

    def write(self, route: str, seed: int, rec: dict[str, Any], sd: dict[str, Any], partial: bool = False) -> None:
        # an iterative route's bytes are over the rounds it ran (a plateau run stops early); one-shot: --rounds
        rounds = int(rec.get("rounds_done", self.a.rounds))
        uplink = self.uplink(route, sd, rounds)
        fed = self.uplink("fedavg", sd, rounds)
        if route in REFRESH_VARIANTS or route in ("fedavg", "fedavg-warm"):
            rec = {**rec, "uplink_curve": [[r, self.uplink(route, sd, r)] for r in range(1, rounds + 1)]}
        kind = (
            "baseline"
            if route == "fedavg"
            else "reference (issue 56's baseline)"
            if route == "fedavg-warm"
            else "control"
            if route in CONTROLS
            else "reference (not deployable)"
            if route == "ensemble-public"
            else "candidate"
        )
        full = {
            "route": route,
            "seed": seed,
            "kind": kind,
            "setting": self.setting(),
            "complete": not partial,
            **rec,
            "uplink_total": uplink,
            "uplink_per_client_round": uplink / (self.a.clients * rounds),
            "uplink_ratio": uplink / fed if route not in CONTROLS and route != "ensemble-public" else None,
            "fedavg_uplink_total": fed,
            "revision": _revision(),
            "device": str(self.device),
            "device_name": (
                self.torch.cuda.get_device_name(self.device)
                if self.device.type == "cuda"
                else platform.processor() or platform.machine()
            ),
            "torch": self.torch.__version__,
            "written": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        }
        p = self.path(route, seed, partial)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(full, indent=1))
        os.replace(tmp, p)
        if not partial:
            with contextlib.suppress(FileNotFoundError):
                self.path(route, seed, True).unlink()
            log(
                f"  {route} seed {seed}: acc {rec['acc']:.2f} %, uplink {uplink:,} B"
                + (f" = {uplink / fed:.5f} x FedAvg's" if full["uplink_ratio"] is not None else "")
                + f"  -> {p.name}"
            )

    # -- the shared public model (route 2's), one per seed for every process ----------------------------
    @contextlib.contextmanager
    def _lock(self, name: str) -> Iterator[None]:
        with open(self.out / "cache" / f"{name}.lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def public_model(self, sd: dict[str, Any]) -> tuple[Any, float]:
        """The model trained on the public set alone (cached: every process and route uses the same one)."""
        torch = self.torch
        seed = sd["seed"]
        if "public" in sd:
            return sd["public"], sd["public_acc"]
        name = f"public-{self.a.arch}-s{seed}-tl{self.a.train_limit}-e{self.a.public_epochs}"
        cache = self.out / "cache" / f"{name}.pt"
        with self._lock(name):
            model = self.model(seed)
            if cache.exists():
                blob = torch.load(cache, map_location=self.device, weights_only=False)
                model.load_state_dict(blob["state"])
                self.step_s = self.step_s or blob["step_s"]
                log(f"seed {seed}: public model loaded from {cache}")
            else:
                t = time.monotonic()
                model.train()
                px, py = sd["pub_x"], sd["pub_y"]
                ce = torch.nn.functional.cross_entropy
                rng = np.random.default_rng([seed, 2])
                _, steps = self.sgd(
                    list(model.parameters()),
                    lambda idx: ce(model(px[idx]), py[idx]),
                    int(px.shape[0]),
                    self.a.public_epochs,
                    rng,
                )
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                step_s = (time.monotonic() - t) / max(steps, 1)
                self.step_s = step_s
                torch.save({"state": model.state_dict(), "step_s": step_s}, cache)
                log(f"seed {seed}: public model trained ({steps} steps, {step_s * 1e3:.1f} ms a step)")
        model.eval()
        acc = self.accuracy(model, self.test_x, self.test_y)
        sd["public"], sd["public_acc"] = model, acc
        return model, acc

    def shared_features(self, sd: dict[str, Any]) -> dict[str, Any]:
        """The frozen backbone's features (route 2's extractor: backbone, stem, adapter) on every client's data,
        the public set and the test set, kept on the device."""
        if "feats" not in sd:
            model, _ = self.public_model(sd)
            sd["feats"] = {
                "clients": [self.features(model, c["x"]) for c in sd["clients"]],
                "pub": self.features(model, sd["pub_x"]),
                "test": self.features(model, self.test_x),
            }
            sd["feats"]["test_np"] = sd["feats"]["test"].cpu().numpy()
        return sd["feats"]

    def protos(self, sd: dict[str, Any]) -> dict[int, np.ndarray]:
        if "protos" not in sd:
            f = self.shared_features(sd)
            ups = [
                class_means(h.cpu().numpy(), c["y_np"], NUM_CLASSES)
                for h, c in zip(f["clients"], sd["clients"], strict=True)
            ]
            sd["protos"] = global_prototypes(ups, NUM_CLASSES, PROTO_DIM)
        return sd["protos"]

    def ridge(self, sd: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        if "ridge" not in sd:
            torch = self.torch
            f = self.shared_features(sd)
            g_sum = b_sum = None
            for h, c in zip(f["clients"], sd["clients"], strict=True):
                # the device's statistics (float64 on the device for speed; the same as ridge_stats)
                ha = torch.cat([h.double(), torch.ones(h.shape[0], 1, dtype=torch.float64, device=self.device)], 1)
                onehot = torch.nn.functional.one_hot(c["y"], NUM_CLASSES).double()
                g, b = (ha.T @ ha).cpu().numpy(), (ha.T @ onehot).cpu().numpy()
                g_sum = g if g_sum is None else g_sum + g
                b_sum = b if b_sum is None else b_sum + b
            if g_sum is None or b_sum is None:
                raise ValueError("ridge: the federation has no clients")
            sd["ridge"] = ridge_solve(g_sum, b_sum)
        return sd["ridge"]

    # -- federated averaging of a module's floating state ----------------------------------------------
    def federate(
        self,
        route: str,
        sd: dict[str, Any],
        glob: Any,
        local_train: Callable[[int, Any, int], None],
        score: Callable[[], float],
        after_round: Callable[[int], None] | None = None,
        topk: int | None = None,
        rounds: int | None = None,
        stop: Callable[[list[list[float]]], bool] | None = None,
        final: Callable[[], float] | None = None,
    ) -> dict[str, Any]:
        """R rounds: each client starts from the global module, trains (`local_train(k, work, round)`), and the
        floating state (parameters, BatchNorm statistics) is averaged weighted by |D_k|; with `topk`, each client
        contributes only the `topk` largest entries of (its update + its residual), the rest kept as its residual
        (error feedback), and the server adds the weighted mean of these sparse updates. Scores the global
        module every --test-every rounds and the last; writes a partial result every round."""
        torch = self.torch
        work = copy.deepcopy(glob)
        gs = [t for t in glob.state_dict().values() if t.is_floating_point()]
        ws = [t for t in work.state_dict().values() if t.is_floating_point()]
        acc_state = [torch.zeros_like(t) for t in gs]
        weights = np.asarray(sd["sizes"], np.float64)
        weights = weights / weights.sum()
        resid: list[Any] = [None] * len(sd["clients"])
        curve: list[list[float]] = []
        a = self.a
        n_rounds = rounds or a.rounds
        started = time.monotonic()
        for r in range(1, n_rounds + 1):
            self.budget.check_pace(started, r - 1, n_rounds, a.yield_late)
            for t in acc_state:
                t.zero_()
            if topk:
                with torch.no_grad():
                    gvec = torch.cat([g.reshape(-1) for g in gs])
                    accv = torch.zeros_like(gvec)
            for k in range(len(sd["clients"])):
                self.budget.check()
                with torch.no_grad():
                    for w, g in zip(ws, gs, strict=True):
                        w.copy_(g)
                local_train(k, work, r)
                with torch.no_grad():
                    if topk:
                        delta = torch.cat([w.reshape(-1) for w in ws]) - gvec
                        if resid[k] is not None:
                            delta += resid[k]
                        idx = torch.topk(delta.abs(), topk, sorted=False).indices
                        sent = torch.zeros_like(delta)
                        sent[idx] = delta[idx]
                        resid[k] = delta - sent
                        accv.add_(sent, alpha=float(weights[k]))
                    else:
                        torch._foreach_add_(acc_state, ws, alpha=float(weights[k]))
            with torch.no_grad():
                if topk:
                    gvec += accv
                    at = 0
                    for g in gs:
                        g.copy_(gvec[at : at + g.numel()].view_as(g))
                        at += g.numel()
                else:
                    for g, s in zip(gs, acc_state, strict=True):
                        g.copy_(s)
            if after_round is not None:
                after_round(r)
            every = 1 if stop is not None else a.test_every
            if r % every == 0 or r == n_rounds:
                curve.append([r, score()])
                if r < n_rounds:
                    self.write(
                        route, sd["seed"], {"acc": curve[-1][1], "curve": curve, "rounds_done": r}, sd, partial=True
                    )
            if a.progress and (r % a.progress == 0 or r == n_rounds):
                log(
                    f"  {route} seed {sd['seed']}: round {r}/{n_rounds}"
                    + (f", acc {curve[-1][1]:.2f}" if curve and curve[-1][0] == r else "")
                )
            if stop is not None and stop(curve):
                log(f"  {route} seed {sd['seed']}: the plateau rule fired at round {r}")
                break
        done = int(curve[-1][0])
        return {"acc": final() if final is not None else curve[-1][1], "curve": curve, "rounds_done": done}

    # -- the jobs --------------------------------------------------------------------------------------
    def job_public(self, sd: dict[str, Any]) -> None:
        t = time.monotonic()
        _, acc = self.public_model(sd)
        self.write("public", sd["seed"], {"acc": acc, "wall_s": time.monotonic() - t}, sd)

    def job_proto(self, sd: dict[str, Any]) -> None:
        t = time.monotonic()
        g = self.protos(sd)
        z = self.shared_features(sd)["test_np"]
        y = self.test_y_np
        wall = time.monotonic() - t
        for route, pred in (("proto-l2", nearest_l2(z, g)), ("proto-cos", nearest_cos(z, g))):
            self.write(
                route,
                sd["seed"],
                {"acc": 100.0 * float((pred == y).mean()), "wall_s": wall, "classes_with_prototype": sorted(g)},
                sd,
            )

    def job_ridge(self, sd: dict[str, Any]) -> None:
        t = time.monotonic()
        w, b = self.ridge(sd)
        pred = head_predict(self.shared_features(sd)["test_np"], w, b)
        self.write(
            "ridge",
            sd["seed"],
            {
                "acc": 100.0 * float((pred == self.test_y_np).mean()),
                "wall_s": time.monotonic() - t,
                "ridge_lambda_rel": RIDGE_LAMBDA,
            },
            sd,
        )

    def _head_route(self, route: str, sd: dict[str, Any], w0: np.ndarray, b0: np.ndarray, adapter: bool) -> None:
        torch = self.torch
        from edge_agent.training.models import ResidualAdapter

        t = time.monotonic()
        f = self.shared_features(sd)
        mods: dict[str, Any] = {"head": torch.nn.Linear(PROTO_DIM, NUM_CLASSES)}
        if adapter:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(sd["seed"])
                mods["adapter"] = ResidualAdapter(PROTO_DIM, ADAPTER_RANK)
        glob = torch.nn.ModuleDict(mods).to(self.device)
        with torch.no_grad():
            glob["head"].weight.copy_(torch.from_numpy(np.asarray(w0, np.float32)))
            glob["head"].bias.copy_(torch.from_numpy(np.asarray(b0, np.float32)))
        ce = torch.nn.functional.cross_entropy
        state: dict[str, Any] = {}
        if adapter:  # round 1's targets: the shared space's global prototypes (the adapter starts as the identity)
            state["g"], state["has"] = self._proto_table(self.protos(sd))
            state["uploads"] = []

        def z_of(m: Any, h: Any) -> Any:
            return m["adapter"](h) if adapter else h

        def local_train(k: int, work: Any, r: int) -> None:
            h, y = f["clients"][k], sd["clients"][k]["y"]

            def loss_of(idx: Any) -> Any:
                z = z_of(work, h[idx])
                loss = ce(work["head"](z), y[idx])
                if adapter:
                    yy = y[idx]
                    align = ((z - state["g"][yy]) ** 2).mean(dim=1) * state["has"][yy]
                    loss = loss + PROTO_LAMBDA * align.mean()
                return loss

            work.train()
            self.sgd(
                list(work.parameters()),
                loss_of,
                int(h.shape[0]),
                self.a.local_epochs,
                np.random.default_rng([sd["seed"], 4, r, k]),
            )
            if adapter:  # the device's prototype upload of z after training (eval mode)
                with torch.no_grad():
                    z = z_of(work, h).cpu().numpy()
                state["uploads"].append(class_means(z, sd["clients"][k]["y_np"], NUM_CLASSES))

        def after_round(r: int) -> None:
            if adapter:
                state["g"], state["has"] = self._proto_table(
                    global_prototypes(state["uploads"], NUM_CLASSES, PROTO_DIM)
                )
                state["uploads"] = []

        def score() -> float:
            glob.eval()
            return self.accuracy(lambda h: glob["head"](z_of(glob, h)), f["test"], self.test_y)

        res = self.federate(route, sd, glob, local_train, score, after_round)
        res["wall_s"] = time.monotonic() - t
        self.write(route, sd["seed"], res, sd)

    def _proto_table(self, protos: dict[int, np.ndarray]) -> tuple[Any, Any]:
        g = np.zeros((NUM_CLASSES, PROTO_DIM), np.float32)
        has = np.zeros(NUM_CLASSES, np.float32)
        for c, p in protos.items():
            g[c], has[c] = p, 1.0
        return self._tensor(g), self._tensor(has)

    def job_head(self, sd: dict[str, Any]) -> None:
        model, _ = self.public_model(sd)
        self._head_route(
            "head", sd, model.head.weight.detach().cpu().numpy(), model.head.bias.detach().cpu().numpy(), adapter=False
        )

    def job_head_ncm(self, sd: dict[str, Any]) -> None:
        w, b = ncm_head(self.protos(sd), NUM_CLASSES, PROTO_DIM)
        self._head_route("head-ncm", sd, w, b, adapter=False)

    def job_head_ridge(self, sd: dict[str, Any]) -> None:
        w, b = self.ridge(sd)
        self._head_route("head-ridge", sd, w, b, adapter=False)

    def job_adapter_head(self, sd: dict[str, Any]) -> None:
        model, _ = self.public_model(sd)
        self._head_route(
            "adapter-head",
            sd,
            model.head.weight.detach().cpu().numpy(),
            model.head.bias.detach().cpu().numpy(),
            adapter=True,
        )

    def job_fedavg(self, sd: dict[str, Any], route: str = "fedavg") -> None:
        torch = self.torch
        t = time.monotonic()
        if route == "fedavg-warm":  # issue 56: FedAvg started from the public-only model (head included)
            glob = copy.deepcopy(self.public_model(sd)[0])
        else:
            glob = self.model(sd["seed"])
        ce = torch.nn.functional.cross_entropy
        plateau = bool(self.a.plateau_cap) and route in ("fedavg", "fedavg-warm")

        def local_train(k: int, work: Any, r: int) -> None:
            c = sd["clients"][k]
            work.train()
            self.sgd(
                list(work.parameters()),
                lambda idx: ce(work(c["x"][idx]), c["y"][idx]),
                c["n"],
                self.a.local_epochs,
                np.random.default_rng([sd["seed"], 1, r, k]),
            )

        def score() -> float:
            glob.eval()
            return self.accuracy(glob, self.test_x, self.test_y)

        def score_curve() -> float:
            glob.eval()
            return self.accuracy(glob, self.curve_x, self.curve_y)

        topk = topk_count(sd["full_params"]) if route == "topk-ef" else None
        if plateau:  # issue 56: scored every round (on --curve-test images), stopped by the plateau rule
            res = self.federate(
                route,
                sd,
                glob,
                local_train,
                score_curve,
                topk=topk,
                rounds=self.a.plateau_cap,
                stop=lambda curve: plateau_at(curve) is not None,
                final=score if self.a.curve_test else None,
            )
            res["plateau_at"] = plateau_at(res["curve"])
            res["capped"] = res["plateau_at"] is None
            res["curve_test_images"] = int(self.curve_x.shape[0])
        else:
            res = self.federate(route, sd, glob, local_train, score, topk=topk)
        res["converged_at"] = converged_at(res["curve"]) if self.a.test_every == 1 or plateau else None
        if topk:
            res["topk"] = topk
        res["wall_s"] = time.monotonic() - t
        self.write(route, sd["seed"], res, sd)

    def job_topk_ef(self, sd: dict[str, Any]) -> None:
        self.job_fedavg(sd, "topk-ef")

    def job_fedavg_warm(self, sd: dict[str, Any]) -> None:
        self.job_fedavg(sd, "fedavg-warm")

    def _ridge_sums(self, model: Any, sd: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        """The sums over devices of their ridge statistics of `model`'s features (each device's G_k, B_k)."""
        torch = self.torch
        g_sum = b_sum = None
        for c in sd["clients"]:
            h = self.features(model, c["x"])
            ha = torch.cat([h.double(), torch.ones(h.shape[0], 1, dtype=torch.float64, device=self.device)], 1)
            onehot = torch.nn.functional.one_hot(c["y"], NUM_CLASSES).double()
            g, b = (ha.T @ ha).cpu().numpy(), (ha.T @ onehot).cpu().numpy()
            g_sum = g if g_sum is None else g_sum + g
            b_sum = b if b_sum is None else b_sum + b
        if g_sum is None or b_sum is None:
            raise ValueError("ridge: the federation has no clients")
        return g_sum, b_sum

    def job_refresh(self, sd: dict[str, Any], route: str = "refresh") -> None:
        """Issue 56's refresh route and its variants (module docstring; REFRESH_VARIANTS)."""
        torch = self.torch
        from protofl.algorithms.cps import make_masks

        t = time.monotonic()
        ratio, period, objective = REFRESH_VARIANTS[route]
        a = self.a
        seed = sd["seed"]
        glob = copy.deepcopy(self.public_model(sd)[0])
        w0, b0 = self.ridge(sd)  # round 1: the statistics of the shared backbone, the head solved
        with torch.no_grad():
            glob.head.weight.copy_(torch.from_numpy(w0))
            glob.head.bias.copy_(torch.from_numpy(b0))
        gs = [v for v in glob.state_dict().values() if v.is_floating_point()]
        work = copy.deepcopy(glob)
        ws = [v for v in work.state_dict().values() if v.is_floating_point()]
        d = sum(v.numel() for v in gs)
        k_top = topk_count(d, ratio)
        weights = np.asarray(sd["sizes"], np.float64)
        weights = weights / weights.sum()
        resid: list[Any] = [None] * len(sd["clients"])
        ce = torch.nn.functional.cross_entropy
        masks = self._tensor(make_masks(NUM_CLASSES, PROTO_DIM, CPS_S, seed=seed).astype(np.float32))

        def cps_global(model: Any) -> tuple[Any, Any]:
            """Devices' CPS-compressed class prototypes of `model`'s z (eval mode), n-weighted by the server,
            reconstructed structured-sparse: the alignment targets (refresh-proto)."""
            s_ = torch.zeros(NUM_CLASSES, PROTO_DIM, dtype=torch.float64, device=self.device)
            n_ = torch.zeros(NUM_CLASSES, dtype=torch.float64, device=self.device)
            for c in sd["clients"]:
                z = self.features(model, c["x"]).double()
                cnt = torch.bincount(c["y"], minlength=NUM_CLASSES).double()
                sums = torch.zeros(NUM_CLASSES, PROTO_DIM, dtype=torch.float64, device=self.device)
                sums.index_add_(0, c["y"], z)
                means = sums / cnt.clamp(min=1)[:, None]
                s_ += cnt[:, None] * means * masks.double()
                n_ += cnt
            g = (s_ / n_.clamp(min=1)[:, None]).float()
            return g, (n_ > 0).float()

        def reference_protos(model: Any) -> tuple[Any, Any]:
            """ERPA's reference prototypes: class means of g's z over the public set (refresh-erpa)."""
            z = self.features(model, sd["pub_x"])
            y = sd["pub_y"]
            cnt = torch.bincount(y, minlength=NUM_CLASSES).float()
            sums = torch.zeros(NUM_CLASSES, PROTO_DIM, device=self.device).index_add_(0, y, z)
            return sums / cnt.clamp(min=1)[:, None], (cnt > 0).float()

        def score(x: Any, y: Any) -> float:
            glob.eval()
            return self.accuracy(glob, x, y)

        anchors = cps_global(glob) if objective == "proto" else None
        round1 = score(self.test_x, self.test_y)
        curve = [[1, score(self.curve_x, self.curve_y) if a.curve_test else round1]]
        downlink: list[int] = [0]
        started = time.monotonic()
        for r in range(2, a.rounds + 1):
            self.budget.check_pace(started, r - 2, a.rounds - 1, a.yield_late)
            resolve = period > 0 and (r - 1) % period == 0
            sums = self._ridge_sums(glob, sd) if resolve else None  # statistics of g as received
            if objective == "erpa":
                anchors = reference_protos(glob)
            with torch.no_grad():
                gvec = torch.cat([g.reshape(-1) for g in gs])
                accv = torch.zeros_like(gvec)
            for k, c in enumerate(sd["clients"]):
                self.budget.check()
                with torch.no_grad():
                    for w, g in zip(ws, gs, strict=True):
                        w.copy_(g)
                work.train()

                def loss_of(idx: Any, c: dict[str, Any] = c, anchors: Any = anchors) -> Any:
                    z = work.features(c["x"][idx])
                    yy = c["y"][idx]
                    loss = ce(work.head(z), yy)
                    if anchors is not None:
                        table, has = anchors
                        loss = loss + PROTO_LAMBDA * (((z - table[yy]) ** 2).mean(dim=1) * has[yy]).mean()
                    return loss

                params = [
                    p
                    for name, p in work.named_parameters()
                    if objective != "ce-frozen-head" or not name.startswith("head.")
                ]
                self.sgd(params, loss_of, c["n"], a.local_epochs, np.random.default_rng([seed, 7, r, k]))
                with torch.no_grad():
                    sent, resid[k] = topk_ef_send(torch.cat([w.reshape(-1) for w in ws]) - gvec, resid[k], k_top)
                    accv.add_(sent, alpha=float(weights[k]))
            with torch.no_grad():
                downlink.append(int((accv != 0).sum().item()))
                gvec += accv
                at = 0
                for g in gs:
                    g.copy_(gvec[at : at + g.numel()].view_as(g))
                    at += g.numel()
                if sums is not None:  # the head re-solved from this round's sums (replacing its sparse update)
                    w1, b1 = ridge_solve(*sums)
                    glob.head.weight.copy_(torch.from_numpy(w1))
                    glob.head.bias.copy_(torch.from_numpy(b1))
            if objective == "proto":  # the devices' prototypes after training, for next round's targets
                anchors = cps_global(glob)
            if r % a.test_every == 0 or r == a.rounds:
                curve.append([r, score(self.curve_x, self.curve_y)])
                if r < a.rounds:
                    self.write(route, seed, {"acc": curve[-1][1], "curve": curve, "rounds_done": r}, sd, partial=True)
            if a.progress and (r % a.progress == 0 or r == a.rounds):
                log(
                    f"  {route} seed {seed}: round {r}/{a.rounds}"
                    + (f", acc {curve[-1][1]:.2f}" if curve[-1][0] == r else "")
                )
        final = score(self.test_x, self.test_y) if a.rounds > 1 else round1
        self.write(
            route,
            seed,
            {
                "acc": final,
                "round1_acc": round1,
                "curve": curve,
                "curve_test_images": int(self.curve_x.shape[0]),
                "rounds_done": a.rounds,
                "topk": k_top,
                "topk_ratio": ratio,
                "resolve_every": period,
                "objective": objective,
                "proto_lambda": PROTO_LAMBDA if objective in ("erpa", "proto") else 0.0,
                "cps_s": CPS_S if objective == "proto" else None,
                "downlink_sparse_values": downlink,
                "wall_s": time.monotonic() - t,
            },
            sd,
        )

    def _local_models(self, sd: dict[str, Any], init: Any, tag: int, each: Callable[[int, Any], None]) -> None:
        """Each device trains its own copy of `init` for R rounds of E epochs (a fresh optimiser each round, as
        under FedAvg), no federation; `each(k, model)` sees the trained model."""
        torch = self.torch
        ce = torch.nn.functional.cross_entropy
        started = time.monotonic()
        for k, c in enumerate(sd["clients"]):
            self.budget.check()
            self.budget.check_pace(started, k, len(sd["clients"]), self.a.yield_late)
            m = copy.deepcopy(init)
            m.train()

            def loss_of(idx: Any, m: Any = m, c: dict[str, Any] = c) -> Any:
                return ce(m(c["x"][idx]), c["y"][idx])

            for r in range(1, self.a.rounds + 1):
                self.sgd(
                    list(m.parameters()),
                    loss_of,
                    c["n"],
                    self.a.local_epochs,
                    np.random.default_rng([sd["seed"], tag, r, k]),
                )
            m.eval()
            each(k, m)
            if self.a.progress:
                log(f"  device {k + 1}/{len(sd['clients'])} trained alone (tag {tag})")

    def job_local(self, sd: dict[str, Any]) -> None:
        t = time.monotonic()
        accs: list[float] = []
        self._local_models(
            sd, self.model(sd["seed"]), 6, lambda k, m: accs.append(self.accuracy(m, self.test_x, self.test_y))
        )
        self.write(
            "local", sd["seed"], {"acc": statistics.fmean(accs), "per_device": accs, "wall_s": time.monotonic() - t}, sd
        )

    def job_distil(self, sd: dict[str, Any]) -> None:
        torch = self.torch
        t = time.monotonic()
        model, _ = self.public_model(sd)
        f = self.shared_features(sd)
        accs: list[float] = []
        pub_probs: list[np.ndarray] = []
        test_probs = torch.zeros(int(self.test_x.shape[0]), NUM_CLASSES, device=self.device)

        def each(k: int, m: Any) -> None:
            accs.append(self.accuracy(m, self.test_x, self.test_y))
            with torch.no_grad():
                pub_probs.append(torch.softmax(m(sd["pub_x"]), 1).cpu().numpy())
                for i in range(0, int(self.test_x.shape[0]), self.eval_bs):
                    test_probs[i : i + self.eval_bs] += torch.softmax(m(self.test_x[i : i + self.eval_bs]), 1)

        self._local_models(sd, model, 5, each)
        wall = time.monotonic() - t
        self.write("local-public", sd["seed"], {"acc": statistics.fmean(accs), "per_device": accs, "wall_s": wall}, sd)
        ens = 100.0 * float((test_probs.argmax(1) == self.test_y).float().mean().item())
        self.write("ensemble-public", sd["seed"], {"acc": ens, "wall_s": wall}, sd)
        phi = f["pub"].cpu().numpy()
        w0, b0 = model.head.weight.detach().cpu().numpy(), model.head.bias.detach().cpu().numpy()
        probs = np.stack(pub_probs)
        for route, counts in (("distil-mean", None), ("distil-counts", sd["counts"])):
            t1 = time.monotonic()
            w, b = distil_head(phi, ensemble_targets(probs, counts), w0, b0)
            pred = head_predict(f["test_np"], w, b)
            self.write(
                route,
                sd["seed"],
                {
                    "acc": 100.0 * float((pred == self.test_y_np).mean()),
                    "wall_s": wall + time.monotonic() - t1,
                    "distil_steps": DISTIL_STEPS,
                },
                sd,
            )

    # -- scheduling --------------------------------------------------------------------------------------
    def calibrate(self) -> None:
        """Seconds per training step of the full model and of a head on features (batch 64), timed here on
        random data after a warm-up: what `estimate` multiplies step counts by."""
        torch = self.torch
        ce = torch.nn.functional.cross_entropy
        x = torch.randn(BATCH * 4, *IN_SHAPE, device=self.device)
        y = torch.randint(0, NUM_CLASSES, (BATCH * 4,), device=self.device)
        h = torch.randn(BATCH * 4, PROTO_DIM, device=self.device)
        out = {}
        for name, mod in (("full", self.model(0)), ("head", torch.nn.Linear(PROTO_DIM, NUM_CLASSES).to(self.device))):
            mod.train()
            inp = x if name == "full" else h
            n_warm, n_time = (3, 10) if name == "full" else (10, 50)

            def loss_of(idx: Any, mod: Any = mod, inp: Any = inp) -> Any:
                idx = idx % inp.shape[0]
                return ce(mod(inp[idx]), y[idx])

            self.sgd(list(mod.parameters()), loss_of, BATCH * n_warm, 1, np.random.default_rng(0))
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            t = time.monotonic()
            self.sgd(list(mod.parameters()), loss_of, BATCH * n_time, 1, np.random.default_rng(1))
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            out[name] = (time.monotonic() - t) / n_time
        self.step_s = self.step_s or out["full"]
        self.head_step_s = out["head"]
        log(
            f"calibrated: {out['full'] * 1e3:.2f} ms a training step of the {self.a.arch}, "
            f"{out['head'] * 1e3:.2f} ms of a head on features (batch {BATCH})"
        )

    def estimate(self, job: str, sd: dict[str, Any]) -> float:
        """Seconds a job is expected to take: this process's time for it on an earlier seed, else steps x the
        seconds per training step timed by `calibrate` (forward-only work at a third of a step), plus 15 %."""
        if job in self.durations:
            return self.durations[job]
        if self.step_s is None or self.head_step_s is None:
            self.calibrate()
        assert self.step_s is not None and self.head_step_s is not None
        step = self.step_s
        a = self.a
        per_epoch = sum(math.ceil(n / BATCH) for n in sd["sizes"])
        images = sum(sd["sizes"]) + int(self.test_x.shape[0])
        evals = int(self.test_x.shape[0]) / BATCH * step / 3
        curve_evals = evals * int(self.curve_x.shape[0]) / int(self.test_x.shape[0])
        if a.plateau_cap and job in ("fedavg", "fedavg-warm"):  # guessed: the rule fires at 2/3 of the cap
            r_guess = max(2 * PLATEAU_WINDOW, 2 * a.plateau_cap // 3)
            return 1.15 * (r_guess * (a.local_epochs * per_epoch * step + curve_evals) + 2 * evals)
        if job in REFRESH_VARIANTS:
            return 1.15 * (
                (a.rounds - 1) * a.local_epochs * per_epoch * step * (1.1 if job != "refresh-proto" else 1.4)
                + (a.rounds // a.test_every + 1) * curve_evals
                + 2 * evals
                + (a.rounds // 10) * images / BATCH * step / 3
            )
        if job in ("fedavg", "topk-ef", "local", "fedavg-warm"):  # no shared backbone
            n_evals = (a.rounds // a.test_every + 1) if job != "local" else a.clients
            return 1.15 * (a.rounds * a.local_epochs * per_epoch * step + n_evals * evals)
        # the shared backbone: trained on the public set (unless this process has it), its features once
        shared = (
            0.0 if "public" in sd else a.public_epochs * math.ceil(PUBLIC_PER_CLASS * NUM_CLASSES / BATCH) * step
        ) + (0.0 if "feats" in sd else images / BATCH * step / 3)
        if job == "distil":
            return 1.15 * (a.rounds * a.local_epochs * per_epoch * step + 2 * a.clients * evals) + shared
        if job in ("head", "head-ncm", "head-ridge", "adapter-head"):
            return (
                1.15
                * (
                    a.rounds * a.local_epochs * per_epoch * self.head_step_s * (3 if job == "adapter-head" else 1)
                    + (a.rounds // a.test_every + 1) * evals / 10
                )
                + shared
            )
        return 1.15 * evals + shared

    def run(self, seeds: Sequence[int], jobs: Sequence[str]) -> int:
        failed = 0
        for seed in seeds:
            todo = [j for j in jobs if not all(self.done(r, seed) for r in JOBS[j])]
            if not todo:
                log(f"seed {seed}: every route asked for is there; skipped")
                continue
            sd = self.prepare(seed)
            probe = self.model(seed)
            sd["full_params"] = self.full_params(probe)
            sd["adapter_params"] = sum(p.numel() for p in probe.adapter.parameters())
            del probe
            for job in todo:
                est = self.estimate(job, sd)
                if est > self.budget.left() and not self.a.start_anyway:
                    msg = (
                        f"SKIPPED {job} seed {seed} ({', '.join(JOBS[job])}): needs ~{est:.0f} s, "
                        f"{self.budget.left():.0f} s of --budget-s left"
                    )
                    log(msg)
                    self.skipped.append(msg)
                    with open(self.out / "skipped.txt", "a") as fh:
                        fh.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {msg}\n")
                    continue
                log(f"seed {seed}: {job} (estimated {est:.0f} s, {self.budget.left():.0f} s left)")
                t = time.monotonic()
                try:
                    if job in REFRESH_VARIANTS:
                        self.job_refresh(sd, job)
                    else:
                        getattr(self, "job_" + job.replace("-", "_"))(sd)
                except BudgetStop as stop:
                    msg = f"STOPPED {job} seed {seed}: {stop} (partial files, if any, say how far)"
                    log(msg)
                    self.skipped.append(msg)
                    with open(self.out / "skipped.txt", "a") as fh:
                        fh.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {msg}\n")
                    failed += 1
                    continue
                self.durations[job] = time.monotonic() - t
                log(f"seed {seed}: {job} done in {self.durations[job]:.1f} s")
            for key in ("public", "feats", "protos", "ridge"):
                sd.pop(key, None)
        if self.skipped:
            log("skipped or stopped for the budget:\n  " + "\n  ".join(self.skipped))
        return failed


def converged_at(curve: Sequence[Sequence[float]], gain: float = 0.2, span: int = 5) -> int | None:
    """The issue's stopping rule on a per-round curve [(round, acc)]: the first round r with
    acc(r) - acc(r - span) < gain points (None if it never fires)."""
    acc = {int(r): a for r, a in curve}
    for r in sorted(acc):
        if r - span in acc and acc[r] - acc[r - span] < gain:
            return r
    return None


@functools.lru_cache(maxsize=1)
def _revision() -> str:
    """The checkout's commit (PREDICTOR_REVISION wins: a copied tree without .git, as on a lent machine)."""
    if os.environ.get("PREDICTOR_REVISION"):
        return os.environ["PREDICTOR_REVISION"]
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent,
            timeout=5,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent,
            timeout=5,
        ).stdout.strip()
        return (rev or "unknown") + (" (dirty)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# --------------------------------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------------------------------


def load_rows(d: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(d.glob("*-s*.json")) if not p.name.endswith(".partial.json")]


def summary(dirs: Sequence[Path]) -> str:
    lines: list[str] = []
    for d in dirs:
        rows = load_rows(d)
        partial = sorted(p.name for p in d.glob("*.partial.json"))
        if not rows:
            lines += [f"## {d}", "", "no results", ""]
            if (d / "skipped.txt").exists():
                lines += ["Skipped for the budget:", "```", (d / "skipped.txt").read_text().rstrip(), "```", ""]
            continue
        s = rows[0]["setting"]
        lines += [
            f"## {d.name}: {s['arch']}, {s['clients']} clients, alpha {s['alpha']}, {s['rounds']} rounds x "
            f"{s['local_epochs']} local epochs, train-limit {s['train_limit']}, {s['test_images']} test images",
            "",
            f"devices: {sorted({r.get('device_name', '?') for r in rows})}; revisions: "
            f"{sorted({r.get('revision', '?') for r in rows})}",
            "",
        ]
        st = route_stats(rows)
        dec = select(rows)
        lines += [
            "| route | kind | seeds | global acc % | B/client/round | uplink total MB | x FedAvg's bytes | "
            "- FedAvg (points) | - public-only (points) | rule |",
            "|---|---|---|--:|--:|--:|--:|---|---|---|",
        ]
        for route in ROUTES:
            if route not in st:
                continue
            acc = st[route]["acc"]
            vals = list(acc.values())
            sd = f" ± {statistics.stdev(vals):.2f}" if len(vals) > 1 else ""
            kind = next(r["kind"] for r in rows if r["route"] == route)
            vf = paired(acc, st["fedavg"]["acc"]).text() if "fedavg" in st and route != "fedavg" else "-"
            vp = paired(acc, st["public"]["acc"]).text() if "public" in st and route != "public" else "-"
            ratio = st[route]["ratio_mean"]
            c = dec["checks"].get(route)
            rule = (
                "-"
                if c is None
                else ("" if c["intervals"] else "means only: ")
                + (
                    "QUALIFIES"
                    if c["qualifies"]
                    else "fails "
                    + ",".join(
                        n
                        for n, ok in (
                            ("(1) bytes", c["bytes_ok"]),
                            ("(2) near FedAvg", c["near_fedavg"]),
                            ("(3) beats public", c["beats_public"]),
                        )
                        if not ok
                    )
                )
            )
            lines.append(
                f"| {route} | {kind} | {','.join(map(str, sorted(acc)))} | {statistics.fmean(vals):.2f}{sd} | "
                f"{statistics.fmean(st[route]['per_client_round']):,.0f} | "
                f"{st[route]['uplink_mean'] / 1e6:.3f} | "
                f"{'-' if ratio is None else f'{ratio:.5f}'} | {vf} | {vp} | {rule} |"
            )
        conv = [r.get("converged_at") for r in rows if r["route"] == "fedavg"]
        lines += [
            "",
            f"FedAvg's stopping rule (gain < 0.2 points over 5 rounds) fired at rounds: {conv}",
            f"Rule verdict: **{dec.get('default') or dec.get('provisional') or 'none'}** -- {dec['why']}",
        ]
        if partial:
            lines.append(f"Unfinished (partial files): {', '.join(partial)}")
        skipped = d / "skipped.txt"
        if skipped.exists():
            lines += ["Skipped for the budget:", "```", skipped.read_text().rstrip(), "```"]
        lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Issue 56: the full-data section's summary, verdict and figure
# --------------------------------------------------------------------------------------------------

FULLDATA_ORDER = ("fedavg-warm", "fedavg", "ridge", "public", *REFRESH_VARIANTS)
GOAL_WITHIN = 1.0  # points (issue 56's goal)


def _by_route(rows: Sequence[dict[str, Any]]) -> dict[str, dict[int, dict[str, Any]]]:
    """route -> seed -> row: the complete row, else a row cut by the time budget (flagged "cut")."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for r in sorted(rows, key=lambda r: bool(r.get("complete", True))):  # complete rows win
        out.setdefault(r["route"], {})[int(r["seed"])] = {**r, "cut": not r.get("complete", True)}
    return out


def _curve_n(r: dict[str, Any]) -> Any:
    return r.get("curve_test_images", r["setting"].get("curve_test", "?"))


def load_fulldata_rows(d: Path) -> list[dict[str, Any]]:
    """Complete rows and the partial files of iterative runs the time budget cut (their `acc` is the last
    scored round's, on the curve images)."""
    return [json.loads(p.read_text()) for p in sorted(d.glob("*-s*.json"))]


def fulldata_verdict(rows: Sequence[dict[str, Any]], route: str = "refresh") -> dict[str, Any]:
    """Issue 56's goal for `route` against fedavg-warm, paired by seed (PREDICTOR.md, "Full data"): (a) the
    interval of route - fedavg-warm above -1; (b) on every seed the route's uplink <= 1/100 of fedavg-warm's at
    its plateau; (c) on every seed accuracy after R rounds above round 1's. Also "at or above": the interval's
    upper end >= 0. Below 2 seeds: a reading of the means."""
    by = _by_route(rows)
    if route not in by or "fedavg-warm" not in by:
        return {"verdict": "NOT MEASURED", "why": f"{route} and fedavg-warm rows are needed"}
    seeds = sorted(set(by[route]) & set(by["fedavg-warm"]))
    if not seeds:
        return {"verdict": "NOT MEASURED", "why": "no seed has both rows"}
    cut = any(by[x][s]["cut"] for x in (route, "fedavg-warm") for s in seeds)

    def acc_of(r: dict[str, Any]) -> float:  # a cut row has no final score on all test images: compare curves
        return float(r["curve"][-1][1]) if cut else float(r["acc"])

    vs = paired({s: acc_of(by[route][s]) for s in seeds}, {s: acc_of(by["fedavg-warm"][s]) for s in seeds})
    ratios = {s: by[route][s]["uplink_total"] / by["fedavg-warm"][s]["uplink_total"] for s in seeds}
    gains = {
        s: (
            by[route][s]["curve"][-1][1] - by[route][s]["curve"][0][1]
            if cut
            else by[route][s]["acc"] - by[route][s].get("round1_acc", by[route][s]["acc"])
        )
        for s in seeds
    }
    iv = vs.interval
    a_ok = (iv[0] > -GOAL_WITHIN) if iv is not None else (vs.mean is not None and vs.mean > -GOAL_WITHIN)
    b_ok = all(v <= RATIO_MAX for v in ratios.values())
    c_ok = all(v > 0 for v in gains.values())
    at_or_above = (iv[1] >= 0) if iv is not None else (vs.mean is not None and vs.mean >= 0)
    met = a_ok and b_ok and c_ok
    verdict = ("MET" if met else "MISSED") + ("" if iv is not None else " (one seed: a reading of the means)")
    if cut:
        cut_at = {x: {s: by[x][s]["curve"][-1][0] for s in seeds if by[x][s]["cut"]} for x in (route, "fedavg-warm")}
        verdict += f" (runs cut by the time budget, rounds {cut_at}: compared on the curve images, last round scored)"
    why = (
        f"{route} - fedavg-warm = {vs.text()}: (a) within {GOAL_WITHIN:g} point {'yes' if a_ok else 'NO'}; "
        f"(b) bytes <= 1/100 on every seed {'yes' if b_ok else 'NO'} (max {max(ratios.values()):.5f}); "
        f"(c) after R above round 1 on every seed {'yes' if c_ok else 'NO'} "
        f"(gains {', '.join(f'{gains[s]:+.2f}' for s in seeds)}); at or above (upper end >= 0): "
        f"{'yes' if at_or_above else 'no'}"
    )
    return {"verdict": verdict, "why": why, "met": met, "vs": vs, "ratios": ratios, "gains": gains, "seeds": seeds}


def defaults_choice(rows: Sequence[dict[str, Any]]) -> str:
    """PREDICTOR.md "Full data" rule 2: the refresh variant the measurement supports as the product's default."""
    by = _by_route(rows)
    if "fedavg-warm" not in by:
        return "no fedavg-warm rows"
    ok: dict[str, dict[int, float]] = {}
    bytes_: dict[str, float] = {}
    for v in REFRESH_VARIANTS:
        if v not in by:
            continue
        seeds = sorted(set(by[v]) & set(by["fedavg-warm"]))
        if any(by[v][x]["cut"] for x in seeds):  # a run the time budget cut is not a candidate
            continue
        if seeds and all(by[v][s]["uplink_total"] / by["fedavg-warm"][s]["uplink_total"] <= RATIO_MAX for s in seeds):
            ok[v] = {s: by[v][s]["acc"] for s in seeds}
            bytes_[v] = statistics.fmean(by[v][s]["uplink_total"] for s in seeds)
    if not ok:
        return "no refresh variant meets the byte bound"
    best = max(ok, key=lambda v: statistics.fmean(ok[v].values()))
    tied = [v for v in ok if v == best or paired(ok[best], ok[v]).beats() != 1]
    # fewest bytes; equal bytes (within 1 %): the product default, then plain cross-entropy, wins
    pref = {v: (0 if v == "refresh" else 1 if REFRESH_VARIANTS[v][2].startswith("ce") else 2) for v in tied}
    low = min(bytes_[v] for v in tied)
    pick = min((v for v in tied if bytes_[v] <= 1.01 * low), key=lambda v: pref[v])
    few = min(len(ok[v]) for v in ok)
    if len(ok) == 1:
        return f"only {pick} ran to R (no other variant to choose from)"
    return (
        f"**{pick}** (K = {REFRESH_VARIANTS[pick][0]}, T = {REFRESH_VARIANTS[pick][1]}, objective "
        f"{REFRESH_VARIANTS[pick][2]}); best mean {best}; not beaten by it: {', '.join(sorted(tied))}"
        + (" -- fewer than 2 seeds for some variant: a reading of the means" if few < 2 else "")
    )


def fulldata_summary(dirs: Sequence[Path]) -> str:
    lines: list[str] = []
    for d in dirs:
        rows = load_fulldata_rows(d)
        if not rows:
            lines += [f"## {d}", "", "no results", ""]
            continue
        s = rows[0]["setting"]
        by = _by_route(rows)
        warm = by.get("fedavg-warm", {})
        lines += [
            f"### {d.name}: {s['arch']}, {s['clients']} clients, alpha {s['alpha']}, train-limit {s['train_limit']}, "
            f"refresh R = {s['rounds']}, FedAvg to the plateau rule (cap {s.get('plateau_cap')}), "
            f"{s['test_images']} test images",
            "",
            f"devices: {sorted({r.get('device_name', '?') for r in rows})}; revisions: "
            f"{sorted({r.get('revision', '?') for r in rows})}",
            "",
            f"| route | seeds | acc % (final, {s['test_images']:,} test) | round 1 % | rounds | uplink MB | "
            "x fedavg-warm's bytes (max) | - fedavg-warm (points, paired) |",
            "|---|---|--:|--:|---|--:|--:|---|",
        ]
        for route in FULLDATA_ORDER:
            if route not in by:
                continue
            rr = by[route]
            accs = [rr[x]["acc"] for x in sorted(rr)]
            sd = f" ± {statistics.stdev(accs):.2f}" if len(accs) > 1 else ""
            r1 = [rr[x]["round1_acc"] for x in sorted(rr) if "round1_acc" in rr[x]]
            rounds = ",".join(
                str(rr[x].get("rounds_done", "-")) + (" (cut: acc on the curve images)" if rr[x]["cut"] else "")
                for x in sorted(rr)
            )
            common = sorted(set(rr) & set(warm))
            ratio = max((rr[x]["uplink_total"] / warm[x]["uplink_total"] for x in common), default=None)
            vs = (
                paired({x: rr[x]["acc"] for x in common}, {x: warm[x]["acc"] for x in common}).text()
                if route != "fedavg-warm" and common
                else "-"
            )
            r1_text = f"{statistics.fmean(r1):.2f}" if r1 else "-"
            lines.append(
                f"| {route} | {','.join(map(str, sorted(rr)))} | {statistics.fmean(accs):.2f}{sd} | {r1_text} | "
                f"{rounds} | "
            )
            lines[-1] += (
                f"{statistics.fmean(rr[x]['uplink_total'] for x in rr) / 1e6:.3f} | "
                f"{'-' if ratio is None else f'{ratio:.5f}'} | {vs} |"
            )
        lines.append("")
        for route in ("fedavg-warm", "fedavg"):
            for x in sorted(by.get(route, {})):
                r = by[route][x]
                stop = (
                    f"CUT by the time budget after round {r['rounds_done']}, no plateau yet"
                    if r["cut"]
                    else f"plateau at round {r['plateau_at']}"
                    if r.get("plateau_at")
                    else f"capped at {r['rounds_done']}"
                )
                lines.append(
                    f"- {route} seed {x} ({stop}; per round on the first {_curve_n(r)} test "
                    f"images): " + " ".join(f"{a:.1f}" for _, a in r["curve"])
                )
        for route in REFRESH_VARIANTS:
            for x in sorted(by.get(route, {})):
                r = by[route][x]
                lines.append(
                    f"- {route} seed {x} (round: acc on the first {_curve_n(r)} test images): "
                    + " ".join(f"{int(rd)}:{a:.1f}" for rd, a in r["curve"])
                )
        v = fulldata_verdict(rows)
        lines += ["", f"Goal (refresh against fedavg-warm): **{v['verdict']}** -- {v['why']}"]
        lines += [f"Defaults the measurement supports (rule 2): {defaults_choice(rows)}"]
        partial = sorted(p.name for p in d.glob("*.partial.json"))
        if partial:
            lines.append(f"Unfinished (partial files): {', '.join(partial)}")
        if (d / "skipped.txt").exists():
            lines += ["Skipped for the budget:", "```", (d / "skipped.txt").read_text().rstrip(), "```"]
        lines.append("")
    return "\n".join(lines)


def fulldata_figure(dirs: Sequence[Path], path: Path) -> str:
    """Accuracy against cumulative uplink bytes, every route and FedAvg, one panel per results directory
    (matplotlib; lines: the per-round curve on the --curve-test images; markers: the final accuracy on all test
    images)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(dirs), figsize=(6.5 * len(dirs), 4.8), squeeze=False)
    cmap = plt.get_cmap("tab10")
    colours = {route: cmap(i % 10) for i, route in enumerate(FULLDATA_ORDER)}
    for ax, d in zip(axes[0], dirs, strict=True):
        rows = load_fulldata_rows(d)
        by = _by_route(rows)
        for route in FULLDATA_ORDER:
            first = True
            for x in sorted(by.get(route, {})):
                r = by[route][x]
                col = colours[route]
                if "uplink_curve" in r:
                    cum = dict((int(a), float(b)) for a, b in r["uplink_curve"])
                    pts = [(cum[int(rd)], a) for rd, a in r["curve"] if int(rd) in cum]
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], "-", color=col, lw=1, alpha=0.7,
                            label=route if first else None)  # fmt: skip
                    ax.plot([r["uplink_total"]], [r["acc"]], "o", color=col, ms=4)
                elif r.get("uplink_total"):
                    ax.plot([r["uplink_total"]], [r["acc"]], "s", color=col, ms=5, label=route if first else None)
                first = False
        if rows:
            s = rows[0]["setting"]
            ax.set_title(
                f"{d.name}: {s['arch']}, {s['clients']} clients, alpha {s['alpha']}, {s['train_limit']} images"
            )
        ax.set_xscale("log")
        ax.set_xlabel("cumulative uplink bytes, all devices")
        ax.set_ylabel("global accuracy % (lines: first test images; dots: all)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    doc = __doc__ or ""
    ap = argparse.ArgumentParser(
        description=doc.split("\n\n")[0],
        epilog=doc.split("\n", 1)[1].strip() + "\n\n" + NUMBERS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out", type=Path, default=None, help="results directory (one per setting)")
    ap.add_argument(
        "--summary",
        type=Path,
        nargs="+",
        default=None,
        help="print the table and the rule's verdict for these results directories, and exit",
    )
    ap.add_argument(
        "--fulldata-summary",
        type=Path,
        nargs="+",
        default=None,
        help="issue 56: the full-data table, plateau curves and verdict for these results directories, and exit",
    )
    ap.add_argument("--figure", type=Path, default=None, help="with --fulldata-summary: draw accuracy against "
                    "cumulative uplink bytes to this PNG")  # fmt: skip
    ap.add_argument(
        "--routes", default="all", help=f"routes or jobs to run, comma-separated (default all); jobs: {', '.join(JOBS)}"
    )
    ap.add_argument("--seeds", default="0", help="comma-separated seeds, or a range 0-4")
    ap.add_argument("--rounds", type=int, default=10, help="rounds R of every federated route (and R x E local epochs)")
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--alpha", type=float, default=0.5, help="Dirichlet label-skew concentration")
    ap.add_argument("--local-epochs", type=int, default=1, help="E, local epochs a round")
    ap.add_argument(
        "--train-limit",
        type=int,
        default=6000,
        help="seeded subset of the training set before partitioning (TABLE.md's 6000; 60000 = all)",
    )
    ap.add_argument("--test-limit", type=int, default=None, help="first N test images only (smoke runs; default all)")
    ap.add_argument(
        "--public-epochs",
        type=int,
        default=PUBLIC_EPOCHS,
        help="epochs of the public-only model (the issue's 60; fewer only for smoke runs)",
    )
    ap.add_argument("--test-every", type=int, default=1, help="score iterative routes every N rounds (and the last)")
    ap.add_argument(
        "--plateau-cap",
        type=int,
        default=None,
        help="issue 56: run fedavg and fedavg-warm to the plateau rule (scored every round), at most this many rounds",
    )
    ap.add_argument(
        "--curve-test",
        type=int,
        default=None,
        help="issue 56: per-round scores (the plateau rule, curves) on the first N test images; round 1's and the "
        "final accuracy on all of them",
    )
    ap.add_argument("--arch", default="cnn", help="the client model (edge_agent.training.models): cnn or resnet18")
    ap.add_argument("--device", default="auto", help="cuda, cpu or auto")
    ap.add_argument(
        "--data-dir", default=None, help="Fashion-MNIST IDX files (default /usr/share/datasets/fashion-mnist)"
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="wall-clock seconds for this process: no job starts that would not finish in time; a job that "
        "runs over stops (leaving its partial file)",
    )
    ap.add_argument(
        "--yield-late",
        action="store_true",
        help="stop a long job once its pace says it cannot finish in --budget-s (frees the GPU for "
        "the processes beside it); without it a job runs until the budget is spent",
    )
    ap.add_argument(
        "--start-anyway",
        action="store_true",
        help="start every job even when its estimate says it will not finish in --budget-s (it stops at the "
        "budget, leaving its partial file: a loaded machine's calibration overestimates)",
    )
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument(
        "--eval-batch", type=int, default=0, help="evaluation batch (0: 4096 cnn / 1024 otherwise on cuda, 500 cpu)"
    )
    ap.add_argument("--progress", type=int, default=5, help="log every N rounds (0: off)")
    a = ap.parse_args(argv)
    if a.summary is not None:
        print(summary(a.summary))
        return 0
    if a.fulldata_summary is not None:
        print(fulldata_summary(a.fulldata_summary))
        if a.figure is not None:
            print(f"figure: {fulldata_figure(a.fulldata_summary, a.figure)}")
        return 0
    if a.out is None:
        ap.error("--out DIR is required (or --summary DIR)")
    if "-" in a.seeds and "," not in a.seeds:
        lo, hi = a.seeds.split("-")
        seeds = list(range(int(lo), int(hi) + 1))
    else:
        seeds = [int(s) for s in a.seeds.split(",")]
    wanted = [w.strip() for w in a.routes.split(",") if w.strip()]
    if wanted == ["all"]:
        jobs = list(JOBS)
    else:
        unknown = [w for w in wanted if w not in JOBS and w not in ROUTES]
        if unknown:
            ap.error(f"unknown route(s)/job(s) {unknown}; routes: {', '.join(ROUTES)}; jobs: {', '.join(JOBS)}")
        jobs = [j for j in JOBS if j in wanted or any(r in wanted for r in JOBS[j])]
    if a.test_every < 1 or a.rounds < 1:
        ap.error("--rounds and --test-every must be >= 1")
    log(
        f"predictor routes: {a.arch}, {a.clients} clients, alpha {a.alpha}, R={a.rounds}, E={a.local_epochs}, "
        f"train-limit {a.train_limit}, seeds {seeds}, jobs {jobs}, budget {a.budget_s} s, out {a.out}"
    )
    runner = Runner(a)
    failed = runner.run(seeds, jobs)
    log(f"finished in {runner.budget.elapsed():.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
