"""FedAvg (McMahan et al., 2017): the sample-weighted mean of full parameter vectors.

The baseline every comparison needs (docs/algorithms.md, "Baselines"): each client uploads its whole
flattened parameter vector theta_k with weight |D_k|, and the server computes

    theta^{t+1} = sum_k |D_k| theta_k / sum_k |D_k|,

which is also eq. (2) of RefProtoFL (paper 000) read as an aggregation rule. The technique below
federates a parameter vector, the whole model (federate="full") or the federated adapter
(federate="adapter"); another technique may replace the mean (a sparse upload's masked mean). The device
half (flatten, load, upload) is edge_agent/techniques/fedavg.py; the server half is a streaming
accumulator that holds one running sum, so memory does not grow with the number of uploads.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from protofl.adapter import Layout, adapter_layout, initial_adapter
from protofl.algorithms.robust import CoordinateRobust
from protofl.errors import WireError
from protofl.mergeable import Additive
from protofl.sparse import SparseVector
from protofl.technique import (
    Clip,
    ClippedUpload,
    Fold,
    Part,
    Phase,
    RoundFields,
    ServerRule,
    ServerState,
    Technique,
    Upload,
)
from protofl.wire import ParamsUpload

__all__ = ["FedAvgAggregator", "FedAvg", "FederatedVector"]


class FedAvgAggregator(Additive):
    """Running sample-weighted mean of dense vectors of length `dim`."""

    additive = ("_num", "_den", "_count")  # mergeable across aggregator shards

    def __init__(self, dim: int) -> None:
        if int(dim) < 1:
            raise ValueError(f"FedAvg: dim must be >= 1, got {dim}")
        self._dim = int(dim)
        self._num = np.zeros(self._dim, dtype=np.float64)
        self._den = 0.0
        self._count = 0

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def senders(self) -> int:
        """How many uploads have been accepted."""
        return self._count

    def add(self, vector: np.ndarray, weight: float) -> None:
        """Fold in one client's vector with weight |D_k|; a rejected upload leaves the state unchanged."""
        w = float(weight)
        if not math.isfinite(w) or w <= 0.0:
            raise ValueError(f"FedAvg: weight must be a finite number > 0 (the client's |D_k|), got {weight!r}")
        v = np.asarray(vector)
        if v.shape != (self._dim,):
            # A wrong length almost always means the client flattened a different architecture.
            raise ValueError(
                f"FedAvg: expected shape ({self._dim},), got {v.shape}; is the client running the same model?"
            )
        # float64 before multiplying: w * float32 would round the product to float32 first.
        v64 = v.astype(np.float64, copy=False)
        if not np.isfinite(v64).all():
            raise ValueError("FedAvg: vector contains NaN or inf; drop this upload")
        self._num += w * v64
        self._den += w
        self._count += 1

    def add_checked(self, vector: np.ndarray, weight: float) -> None:
        """`add` for the vector of a decoded ParamsUpload (finite: the decoder checked it): its shape and the
        weight are checked, its values not passed over a second time; the same sums as `add`."""
        w = float(weight)
        if not math.isfinite(w) or w <= 0.0:
            raise ValueError(f"FedAvg: weight must be a finite number > 0 (the client's |D_k|), got {weight!r}")
        v = np.asarray(vector)
        if v.shape != (self._dim,):
            raise ValueError(
                f"FedAvg: expected shape ({self._dim},), got {v.shape}; is the client running the same model?"
            )
        self._num += w * v.astype(np.float64, copy=False)
        self._den += w
        self._count += 1

    def result(self) -> np.ndarray:
        """The weighted mean as float32; raises if nothing was added (there is no mean to take)."""
        if self._count == 0:
            raise ValueError("FedAvg: no uploads were added; keep the previous global model instead")
        return (self._num / self._den).astype(np.float32)


# -- the technique ------------------------------------------------------------------------------------
class FedAvg(Technique):
    """A federated parameter vector: the whole model, or the adapter."""

    name = "fedavg"
    order = 10

    def active(self, cfg: Any) -> bool:
        return bool(cfg.federate != "none")

    def server_rule(self, model: ServerState) -> ServerRule:
        return FedAvgRule(model)


@dataclass
class FederatedVector:
    """FedAvg's server state: the global parameter vector, the federated adapter or the whole model's parameters
    (known from the start where the server has the model: the simulator; else from the first round's uploads)."""

    adapter: np.ndarray | None = None
    params: np.ndarray | None = None


class FedAvgRule(ServerRule):
    fills = frozenset({"adapter", "params"})

    def __init__(self, model: ServerState) -> None:
        super().__init__(model)
        self.state = FederatedVector()
        cfg = model.cfg
        self.layout = (
            adapter_layout(cfg.proto_dim, cfg.adapter_rank, cfg.num_classes) if cfg.federate == "adapter" else None
        )

    def init_model(self) -> None:
        """Round 0: the adapter from the config's seed; the whole model's parameters where the server knows them
        (without, the devices start from the config seed's model, identical everywhere; the simulator passes
        the vector so that round 1's downlink is counted)."""
        if self.layout is not None:
            self.state.adapter = initial_adapter(self.layout, seed=self.model.cfg.seed)
        elif self.model.initial_params is not None:
            self.state.params = np.asarray(self.model.initial_params, np.float32)

    def adapter_layout(self) -> Layout | None:
        return self.layout

    def uploads(self) -> Mapping[Phase, tuple[Upload, ...]]:
        return {Phase.TRAIN: (Upload.ADAPTER,)}

    def folds(self, phase: Phase) -> list[Fold]:
        return [VectorFold(self.model, self.state)] if phase is Phase.TRAIN else []

    def stale(self, upload: object, round_: int) -> str | None:
        """An adapter trained from another round's adapter (the round message carries the adapter)."""
        if isinstance(upload, ParamsUpload) and self.layout is not None and upload.base_round != round_:
            return f"adapter trained from round {upload.base_round}'s adapter, now {round_}"
        return None

    def round_fields(self, phase: Phase) -> RoundFields | None:
        """The full adapter in the round message of the plan's adapter phase, the whole model's parameters in
        the training phase's (once known); both in the final one."""
        state, final = self.state, phase is Phase.DONE
        return RoundFields(
            adapter=state.adapter if final or self.model.plan.adapter_phase is phase else None,
            params=state.params if final or phase is Phase.TRAIN else None,
        )


class VectorFold(Fold):
    """The training phase's parameter vectors, clipped around the global one and averaged."""

    kinds = (Upload.ADAPTER,)
    merged = ("acc", "robust")

    def __init__(self, model: ServerState, state: FederatedVector) -> None:
        self.model, self.state = model, state
        self.full = model.cfg.federate == "full"
        self.reference: np.ndarray | None = state.params if self.full else state.adapter
        # FedAvg without a known model (a server with no torch): the first upload fixes the length, and there
        # is nothing to clip around: such uploads are folded as sent.
        self.clip = {Part.UPDATE: Clip("adapter", self.reference) if self.reference is not None else None}
        self.acc: Any = None
        self.robust: CoordinateRobust | None = None
        if self.reference is not None:
            self._start(self.reference.shape[0])

    def _start(self, n: int) -> None:
        model = self.model
        other = model.rules.vector_aggregator(self.reference) if self.reference is not None else None
        self.acc = other if other is not None else FedAvgAggregator(n)
        self.sparse_ok = other is not None
        if self.reference is not None:
            self.robust = model.robust_mean(n)

    def check(self, up: ClippedUpload) -> Any:
        update = up.update
        assert update is not None
        if up.n_samples <= 0:
            raise WireError("adapter upload with n_samples = 0")
        if update.indices is not None and self.full:
            raise WireError("FedAvg needs the full parameter vector, got a sparse update")
        if update.indices is not None and self.acc is not None and not self.sparse_ok:
            raise WireError("this federation averages dense parameter vectors; got a sparse update")
        n = update.n
        expected = self.reference.shape[0] if self.reference is not None else (self.acc.dim if self.acc else n)
        if n != expected:
            raise WireError(f"adapter of length {n}, expected {expected}")
        idx = update.indices  # sorted (a SparseVector's invariant, checked by the decoder): the ends suffice
        if idx is not None and idx.shape[0] and (idx[0] < 0 or idx[-1] >= n):
            raise WireError(f"adapter indices out of range [0, {n})")
        return update, float(up.n_samples)

    def fold(self, prepared: Any) -> None:
        view, weight = prepared
        update = view.vector  # clipped by the phase around the reference
        if self.acc is None:
            self._start(update.shape[0])
        # A decoded upload's vector was checked by the decoder: the in-tree aggregators skip a second pass over
        # it (add_checked); another technique's aggregator takes add, which checks.
        getattr(self.acc, "add_checked", self.acc.add)(update, weight)  # (feeds the mean, unused when robust)
        if self.robust is not None:
            if isinstance(update, SparseVector):
                self.robust.add(update.values.astype(np.float64), update.indices)
            else:
                self.robust.add(np.asarray(update, np.float64))

    def merge(self, part: Mapping[str, Any], *, check: bool = False) -> None:
        """Another shard's partial; without a known model its length is the first one any shard saw."""
        theirs = part.get("acc") if isinstance(part, Mapping) else None
        if self.acc is None and isinstance(theirs, Mapping) and isinstance(theirs.get("_num"), np.ndarray):
            if check:
                return  # nothing here to hold it to: the first length wins, as the first upload's does
            self._start(theirs["_num"].shape[0])
        super().merge(part, check=check)

    def finish(self) -> None:
        if self.acc is None or self.acc.senders == 0:
            return
        if self.robust is None:
            result = self.acc.result()
        else:
            assert self.reference is not None  # a robust mean exists only around a known reference
            result = self.robust.result(self.reference).astype(np.float32)
        if self.full:
            self.state.params = result
        else:
            self.state.adapter = result
