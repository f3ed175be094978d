"""The ridge predictor (Fed3R: Fani et al., "Accelerating Heterogeneous Federated Learning with Closed-form
Classifiers", ICML 2024): one deployable global classifier, solved in closed form from statistics each device
sends once.

Every device embeds its training data with the federation's shared backbone (the model trained on the server's
public set, or a user's checkpoint: it travels once, with the public set; edge_agent/training/backbone.py), h_i in R^d,
appends a constant 1 (the bias), and sends once the sufficient statistics of a ridge regression of one-hot
labels on those features,

    G_k = sum_i [h_i, 1]^T [h_i, 1]        ((d+1) x (d+1), symmetric: its upper triangle travels)
    B_k = sum_i [h_i, 1]^T onehot(y_i)     ((d+1) x C),

as one dense float32 vector [triu(G_k), B_k] (a parameter upload of the training phase; later rounds send it
empty). The server sums them over the devices, G = sum_k G_k, B = sum_k B_k, and solves

    theta = (G + lambda I)^{-1} B,   lambda = ridge_lambda * trace(G) / (d + 1),

so the head is W = theta[:d]^T (C x d), b = theta[d] (C): exactly the ridge classifier a server holding every
device's data would fit on those features, whatever the label skew (the sums do not depend on how the data is
split). The global predictor is the shared backbone with this head; `protofl-export onnx --from run/global`
exports it and `protofl-edge predict` labels with it. lambda relative to the mean diagonal is our choice (Fed3R
fixes an absolute lambda for its features); 1e-3 was fixed before the benchmark's device runs
(bench/results/PREDICTOR.md, where this route beat FedAvg's global model in settings A and B at 0.16 % of its
uplink bytes).

With the route off (`ridge_topk = 0`), a device sends its statistics in the first round it trains; a repeat from a
device already counted (one that lost its state and sent them again) is not added twice: the one-shot predictor.

The route (issue 56; opt-in, `--set ridge_topk=0.001`: off by default because it made the deployable predictor worse
where measured, docs/algorithms.md "The route"): the devices' training reaches the deployable model. The global
model g is the shared backbone's whole parameter vector whose head (its last C x d + C values: W row-major, then b,
the layout of edge_agent/training/params.full_vector) is the ridge head. Round 1 sends statistics as above; g's
head becomes their solve. In each later round every training device copies g, fine-tunes all of it on its own data
with cross-entropy (the config's optimiser and local epochs), and uploads the sparse update (top-K with error
feedback, Seide et al. 2014, Stich et al. 2018)

    d_k = (g_k - g) + e_k,   u_k = top_K(|d_k|),   e_k <- d_k - u_k,   K = ridge_topk x len(g),

and the server applies their n_samples-weighted mean (an entry absent from an upload is 0 in it),

    g <- g + sum_k |D_k| u_k / sum_k |D_k|           (float64 sum, added to g in float64, stored float32),

then ships g's new values at the union of the uploads' indices in the next round message (`ModelUpdate`): every
device holds g bit for bit as the server does. Every T = `ridge_every` rounds (rounds 1, T + 1, 2T + 1, ...; T = 0:
only round 1) the devices send fresh statistics of g's current backbone instead, and the head is solved from that
round's sums only (statistics of two versions of g are never added) and replaces g's head. A device holding another
version of g than the round message's (it missed a round) uploads an empty vector; the next round message carries the
whole g. The global predictor after each round is g. numpy only.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from protofl.errors import ConfigError, WireError
from protofl.mergeable import NotMergeable
from protofl.sparse import SparseVector
from protofl.technique import (
    Clip,
    ClippedUpload,
    Fold,
    Option,
    Part,
    Phase,
    PlanDraft,
    RoundFields,
    ServerRule,
    ServerState,
    Technique,
    Upload,
    flag,
    integer,
    is_number,
)
from protofl.wire import ModelUpdate

__all__ = [
    "Ridge",
    "forget",
    "RidgeState",
    "apply_update",
    "head_slice",
    "is_stats_round",
    "route_k",
    "select_topk",
    "ridge_head",
    "ridge_length",
    "ridge_solve",
    "ridge_statistics",
    "split_statistics",
]

log = logging.getLogger("protofl.ridge")

LAMBDA = 1e-3  # ridge_lambda's default: relative to the mean diagonal of G (bench/results/PREDICTOR.md)


def ridge_length(dim: int, num_classes: int) -> int:
    """Values of one device's statistics vector: the upper triangle of G and B."""
    d1 = dim + 1
    return d1 * (d1 + 1) // 2 + d1 * num_classes


def ridge_statistics(h: np.ndarray, y: np.ndarray, num_classes: int) -> np.ndarray:
    """A device's upload: [triu(G), B] of features `h` (n, d) and labels `y` (float64 sums, float32 out)."""
    h = np.asarray(h, np.float64)
    n, d = h.shape
    ha = np.empty((n, d + 1))
    ha[:, :d] = h
    ha[:, d] = 1.0
    onehot = np.zeros((n, num_classes))
    onehot[np.arange(n), np.asarray(y, np.int64)] = 1.0
    g = ha.T @ ha
    b = ha.T @ onehot
    return np.concatenate([g[np.triu_indices(d + 1)], b.ravel()]).astype(np.float32)


def split_statistics(vector: np.ndarray, dim: int, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """(G (d+1, d+1) symmetric, B (d+1, C)) from a statistics vector (or a sum of them), float64."""
    d1 = dim + 1
    v = np.asarray(vector, np.float64)
    if v.shape != (ridge_length(dim, num_classes),):
        raise ValueError(f"ridge statistics of length {v.shape}, expected {ridge_length(dim, num_classes)}")
    t = d1 * (d1 + 1) // 2
    g = np.zeros((d1, d1))
    g[np.triu_indices(d1)] = v[:t]
    g = g + np.triu(g, 1).T
    return g, v[t:].reshape(d1, num_classes)


def ridge_solve(g: np.ndarray, b: np.ndarray, lam_rel: float = LAMBDA) -> tuple[np.ndarray, np.ndarray]:
    """theta = (G + lambda I)^-1 B with lambda = lam_rel x the mean diagonal of G; the head (W (C, d), b (C,))."""
    d1 = g.shape[0]
    lam = lam_rel * float(np.trace(g)) / d1
    if not lam > 0:
        raise ValueError("ridge: no statistics to solve from (the trace of G is 0)")
    theta = np.linalg.solve(g + lam * np.eye(d1), b)
    return np.ascontiguousarray(theta[:-1].T, np.float32), np.ascontiguousarray(theta[-1], np.float32)


def ridge_head(
    vector: np.ndarray, dim: int, num_classes: int, lam_rel: float = LAMBDA
) -> tuple[np.ndarray, np.ndarray]:
    """The closed-form head from summed statistics."""
    return ridge_solve(*split_statistics(vector, dim, num_classes), lam_rel)


# ridge_topk's default: 0, the route off (the one-shot predictor). The route is opt-in (`--set ridge_topk=0.001`, the
# fraction of g's values a device uploads a round): measured, it made the deployable predictor worse than the one-shot
# head (docs/algorithms.md "The route").
TOPK = 0.0
EVERY = 10  # ridge_every's default: rounds between statistics (round 1, 11, 21, ...)


def head_slice(length: int, dim: int, num_classes: int) -> slice:
    """Where the head (W (C, d) row-major, then b (C,)) lies in g: its last C x d + C values."""
    n = num_classes * dim + num_classes
    if length <= n:
        raise ValueError(f"a global model of {length} values has no room for a head of {n}")
    return slice(length - n, length)


def is_stats_round(round_: int, every: int) -> bool:
    """Whether round `round_` sends ridge statistics (round 1, then every `every` rounds: 1, T+1, 2T+1, ...)."""
    return round_ == 1 or (every > 0 and round_ > 1 and (round_ - 1) % every == 0)


def route_k(length: int, topk: float) -> int:
    """K of the route's top-K for a g of `length` values: at least 1."""
    return max(1, int(round(float(topk) * length)))


def select_topk(delta: np.ndarray, k: int) -> SparseVector:
    """The K largest |delta| entries (ties to the lower index), sorted by index, float32."""
    d = np.asarray(delta, np.float32)
    k = min(int(k), d.shape[0])
    if k <= 0:
        return SparseVector(d.shape[0], np.zeros(0, np.int64), np.zeros(0, np.float32))
    mag = np.abs(d)
    part = np.argpartition(-mag, k - 1, kind="introselect")[:k] if k < d.shape[0] else np.arange(d.shape[0])
    # argpartition's choice among equal magnitudes is not specified: settle the K-th value's ties by index.
    kth = mag[part].min()
    above = np.flatnonzero(mag > kth)
    ties = np.flatnonzero(mag == kth)[: k - above.size]
    idx = np.sort(np.concatenate([above, ties])).astype(np.int64)
    return SparseVector(d.shape[0], idx, d[idx].copy())


def apply_update(g: np.ndarray, mean: np.ndarray, touched: np.ndarray) -> tuple[np.ndarray, SparseVector]:
    """g (float32) plus the weighted mean `mean` (float64, g's length) at the `touched` entries: (the new g, its
    new values at those entries as a sparse vector of g's length)."""
    idx = np.flatnonzero(touched).astype(np.int64)
    new = np.array(g, np.float32, copy=True)
    new[idx] = (new[idx].astype(np.float64) + mean[idx]).astype(np.float32)
    return new, SparseVector(new.shape[0], idx, new[idx].copy())


def _check_topk(value: Any) -> str | None:
    if not is_number(value):
        return f"config 'ridge_topk' must be a finite number, got {value!r}"
    return None if 0 <= value < 1 else f"ridge_topk must be in [0, 1) (a fraction of g's values), got {value}"


def route_on(cfg: Any) -> bool:
    """Whether the ridge predictor runs its route (the devices' training reaches g): ridge_topk > 0."""
    return float(cfg.options.get("ridge_topk", TOPK)) > 0


def _check_lambda(value: Any) -> str | None:
    if not is_number(value):
        return f"config 'ridge_lambda' must be a finite number, got {value!r}"
    return None if value > 0 else f"ridge_lambda must be > 0 (relative to the mean diagonal of G), got {value}"


class Ridge(Technique):
    """The closed-form global head on the shared backbone; the switch `ridge`."""

    name = "ridge"
    order = 95  # after every technique that shapes the training phase's uploads
    options = {
        "ridge": flag("ridge"),
        "ridge_lambda": Option(LAMBDA, _check_lambda),
        # Epochs of the shared backbone's training on the public set (edge_agent/training/backbone.py); 0: the seeded
        # initial model is the backbone (random features), as it is without a public set.
        "backbone_epochs": integer("backbone_epochs", 60, 0),
        # The route (issue 56): the fraction of g's values a device uploads in an update round (0: the one-shot
        # predictor, statistics once), and the rounds between fresh statistics (0: only round 1).
        # Both added after devices and reports were in use: they travel only when set (the default federation sends the
        # config it sent before the route, and an earlier device still joins it).
        "ridge_topk": Option(TOPK, _check_topk, only_when_set=True),
        "ridge_every": Option(EVERY, integer("ridge_every", EVERY, 0).check, only_when_set=True),
    }

    def check(self, cfg: Any) -> None:
        if not route_on(cfg):
            return
        off = "or turn the route off with --set ridge_topk=0 (the one-shot ridge predictor)"
        # Secure aggregation and differential privacy are refused with any parameter upload beside prototypes, the
        # statistics too (protofl/privacy.py, which says what to turn off); the route adds nothing to refuse there.
        if cfg.buffer_k:
            raise ConfigError(
                f"the ridge predictor's route (ridge_topk > 0) applies each round's updates to one version of the "
                f"global model; buffered asynchronous rounds mix versions: leave buffer_k unset {off}"
            )

    def active(self, cfg: Any) -> bool:
        # A predictor for federations that share no model. Where one is federated (federate = "full" or
        # "adapter": the protofl preset with `--set federate=adapter`), that model is the global predictor, and
        # its parameter upload is the one the statistics would ride: the switch then does nothing (docs/algorithms.md).
        return bool(cfg.options.get("ridge")) and cfg.federate == "none"

    def shape(self, draft: PlanDraft, cfg: Any) -> None:
        draft.shared_backbone = True
        last = draft.phases[-1]
        kinds = set(draft.uploads.get(last, ())) | {Upload.ADAPTER}
        draft.uploads = {**draft.uploads, last: tuple(k for k in Upload if k in kinds)}

    def server_rule(self, model: ServerState) -> ServerRule:
        return RidgeRule(model)


@dataclass
class RidgeState:
    """The summed statistics of every device counted so far (with the route: of the last statistics round), and who
    they are (sorted); with the route, the global model g and its last change."""

    stats: np.ndarray | None = None  # float64, ridge_length(d, C)
    contributors: list[str] = field(default_factory=list)
    samples: int = 0
    # The route: g (float32, the whole model vector; None: no route), how many times it changed, the entries that
    # changed last and their new values (what the round message carries), and whether some device said it holds
    # another version (the next round message then carries the whole g).
    g: np.ndarray | None = None
    g_version: int = 0
    g_changed: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    g_values: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    g_resync: bool = False
    g_updates: int = 0  # the uploads the last update round applied


def forget(state: RidgeState, client: str, stats: np.ndarray, dim: int, num_classes: int) -> RidgeState:
    """`state` without `client`: its statistics vector `stats` (as it sent them) subtracted from the sums, its name
    and samples taken out. The head solved from the result is the one of a federation that never had it, as far as
    the sums go: G and B are sums, so G - G_k and B - B_k are what the others' statistics sum to (exactly, where the
    float64 sums of the float32 vectors were: they are, unless their magnitudes span more than 2^29). It does not
    undo what the device's uploads did to anything else: a backbone its updates shaped stays shaped by them."""
    if client not in state.contributors:
        raise ValueError(f"ridge: {client} contributed no statistics to forget")
    g, b = split_statistics(stats, dim, num_classes)
    assert state.stats is not None
    rest = [c for c in state.contributors if c != client]
    left = np.asarray(state.stats, np.float64) - np.asarray(stats, np.float64)
    return RidgeState(
        stats=left if rest else None, contributors=rest, samples=state.samples - int(round(float(g[-1, -1])))
    )


class RidgeRule(ServerRule):
    fills = frozenset({"predictor", "model"})

    def __init__(self, model: ServerState) -> None:
        super().__init__(model)
        self.state = RidgeState()
        cfg = model.cfg
        self.dim, self.classes = int(cfg.proto_dim), int(cfg.num_classes)
        self.length = ridge_length(self.dim, self.classes)
        self.every = int(cfg.options.get("ridge_every", EVERY))
        self.topk = float(cfg.options.get("ridge_topk", TOPK))
        self._head: tuple[Any, tuple[np.ndarray, np.ndarray] | None] = (-1, None)
        self.route = route_on(cfg) and model.shared_backbone is not None
        if route_on(cfg) and not self.route:
            log.info(
                "ridge: the route (ridge_topk > 0) needs the shared backbone the public message ships (a public set "
                "or a backbone); there is none: the predictor is the one-shot ridge head of round 1"
            )

    def init_model(self) -> None:
        if self.route:
            backbone = self.model.shared_backbone
            assert backbone is not None
            self.state.g = np.array(backbone, np.float32, copy=True)
            head_slice(self.state.g.shape[0], self.dim, self.classes)  # (a head fits)

    @property
    def length_g(self) -> int:
        return 0 if self.state.g is None else int(self.state.g.shape[0])

    def stats_round(self, round_: int) -> bool:
        return is_stats_round(round_, self.every)

    def uploads(self) -> Mapping[Phase, tuple[Upload, ...]]:
        return {self.model.plan.phases[-1]: (Upload.ADAPTER,)}

    def folds(self, phase: Phase) -> list[Fold]:
        if phase is not self.model.plan.phases[-1]:
            return []
        if self.route and not self.stats_round(self.current_round()):
            return [UpdateFold(self)]
        return [RidgeFold(self)]

    def current_round(self) -> int:
        """The round whose phase is open (the rules learn it from the model; 1 before any)."""
        return int(self.model.round or 1)

    def round_fields(self, phase: Phase) -> RoundFields | None:
        """The head in the final round message: every device keeps the federation's predictor beside its model;
        with the route, g's last change (or all of g) in every round message."""
        st = self.state
        model = None
        if self.route and st.g is not None and (phase is Phase.DONE or phase is self.model.plan.phases[-1]):
            n = st.g.shape[0]
            model = ModelUpdate(
                version=st.g_version,
                update=SparseVector(n, st.g_changed, st.g_values),
                dense=st.g if st.g_resync else None,
            )
        return RoundFields(predictor=self.predictor_head() if phase is Phase.DONE else None, model=model)

    def predictor_head(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The global head (W (C, d), b (C,)): with the route, g's head once solved; else from the statistics
        counted so far; None before any."""
        st = self.state
        if self.route:
            if st.g is None or st.g_version == 0:
                return None
            sl = head_slice(st.g.shape[0], self.dim, self.classes)
            h = st.g[sl]
            cd = self.classes * self.dim
            return h[:cd].reshape(self.classes, self.dim).copy(), h[cd:].copy()
        if st.stats is None or not st.contributors:
            return None
        key, head = self._head
        if key != len(st.contributors) or head is None:
            head = ridge_head(st.stats, self.dim, self.classes, float(self.model.cfg.ridge_lambda))
            self._head = (len(st.contributors), head)
        return head

    def predictor_backbone(self) -> np.ndarray | None:
        st = self.state
        return st.g if self.route and st.g_version > 0 else None

    def predictor_info(self) -> dict[str, Any]:
        st = self.state
        info: dict[str, Any] = {"kind": "ridge", "devices": len(st.contributors), "samples": int(st.samples)}
        if self.route and st.g is not None:
            shipped = self.model.shared_backbone
            assert shipped is not None
            body = head_slice(st.g.shape[0], self.dim, self.classes).start
            # How many of the backbone's values (the head aside) the devices' updates have changed since it shipped.
            changed = int(np.count_nonzero(st.g[:body] != np.asarray(shipped, np.float32)[:body]))
            info.update(
                route="topk", topk=self.topk, every=self.every, version=int(st.g_version), backbone_changed=changed
            )
        return info

    def solve_into_g(self) -> None:
        """The head solved from the statistics just summed replaces g's head (a new version of g)."""
        st = self.state
        assert st.g is not None and st.stats is not None
        w, b = ridge_head(st.stats, self.dim, self.classes, float(self.model.cfg.ridge_lambda))
        sl = head_slice(st.g.shape[0], self.dim, self.classes)
        g = st.g.copy()
        g[sl] = np.concatenate([w.reshape(-1), b]).astype(np.float32)
        idx = np.arange(sl.start, sl.stop, dtype=np.int64)
        st.g, st.g_changed, st.g_values, st.g_version = g, idx, g[idx].copy(), st.g_version + 1


def _one_aggregator(rule: RidgeRule) -> None:
    if route_on(rule.model.cfg):
        raise NotMergeable(
            "the ridge predictor's route (ridge_topk > 0) runs on one aggregator (g and its versions live there): "
            "drop --shards, or turn the route off with --set ridge_topk=0"
        )


class RidgeFold(Fold):
    """The training phase's statistics vectors: checked, summed; an empty one (a device that sent its own before,
    or, with the route, one that holds another version of g) adds nothing."""

    kinds = (Upload.ADAPTER,)
    # Statistics are sums over a device's samples, not a model: there is no centre to clip them around, and a
    # norm bound would bias the fit. They are checked instead (shape, counts, G's diagonal).
    clip: Mapping[Part, Clip | None] = {Part.UPDATE: None}
    merged = ("stats", "senders", "samples", "behind")

    def __init__(self, rule: RidgeRule) -> None:
        self.rule = rule
        self.stats = np.zeros(rule.length)
        self.senders: list[str] = []
        self.samples = 0
        self.behind: list[str] = []  # the route: devices that hold another version of g

    def check(self, up: ClippedUpload) -> Any:
        update = up.update
        assert update is not None
        rule = self.rule
        if update.n != rule.length:
            more = ""
            if rule.route and update.n == rule.length_g:
                more = f"; round {rule.current_round()} is a statistics round (ridge_every={rule.every}), not an update"
            raise WireError(
                f"ridge statistics of length {update.n}, expected {rule.length} "
                f"(features of {rule.dim} values, {rule.classes} classes){more}"
            )
        if update.indices is not None:
            if update.indices.size:
                raise WireError("ridge statistics travel dense (or empty, once sent)")
            return ("behind", up.sender) if rule.route else None
        v = np.asarray(update.vector, np.float64)
        if not np.isfinite(v).all():
            raise WireError("ridge statistics: a value is not finite")
        g, b = split_statistics(v, rule.dim, rule.classes)
        n = g[-1, -1]
        # Statistics of the device's data, sent once: folded as sent, whatever weight an older upload's
        # prototypes get (checked against the count the device sent, not the weighted one).
        sent = up.n_samples / up.weight
        if abs(n - sent) > 1e-6 * max(1.0, sent) or not n >= 1:
            raise WireError(f"ridge statistics count {n:g} samples, the upload says {sent:g}")
        counts = b[-1]
        if (counts < 0).any() or abs(float(counts.sum()) - n) > 0.5:
            raise WireError("ridge statistics: the class counts do not sum to the samples")
        if (np.diag(g) < 0).any():
            raise WireError("ridge statistics: G has a negative diagonal (not a sum of squares)")
        if not rule.route and up.sender and up.sender in rule.state.contributors:
            log.info("ridge: %s sent its statistics again; they were counted already, not added twice", up.sender)
            return None
        return v, up.sender, int(n)

    def fold(self, prepared: Any) -> None:
        if prepared is None:
            return
        if isinstance(prepared[0], str):  # ("behind", sender)
            self.behind.append(prepared[1])
            return
        v, sender, n = prepared
        self.stats += v
        self.senders.append(sender)
        self.samples += n

    def partial(self) -> dict[str, Any]:
        _one_aggregator(self.rule)
        return {
            "stats": self.stats.copy(),
            "senders": list(self.senders),
            "samples": self.samples,
            "behind": list(self.behind),
        }

    def merge(self, part: Mapping[str, Any], *, check: bool = False) -> None:
        if not isinstance(part, Mapping) or set(part) != set(self.merged or ()):
            raise ValueError(f"RidgeFold: partial has {sorted(part) if isinstance(part, Mapping) else part!r}")
        stats, senders, samples, behind = part["stats"], part["senders"], part["samples"], part["behind"]
        if not isinstance(stats, np.ndarray) or stats.shape != self.stats.shape or not np.isfinite(stats).all():
            raise ValueError(f"RidgeFold.stats: expected a finite array of shape {self.stats.shape}")
        for name, names in (("senders", senders), ("behind", behind)):
            if not isinstance(names, list) or not all(isinstance(s, str) for s in names):
                raise ValueError(f"RidgeFold.{name}: expected a list of client ids")
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
            raise ValueError("RidgeFold.samples: expected an integer >= 0")
        if check:
            return
        self.stats += stats
        self.senders.extend(senders)
        self.samples += samples
        self.behind.extend(behind)

    def finish(self) -> None:
        rule, st = self.rule, self.rule.state
        if rule.route:
            # A fresh head from this round's sums only: statistics of two versions of g are never added.
            st.g_resync = bool(self.behind)
            if not self.senders:
                return
            st.stats, st.contributors, st.samples = self.stats.copy(), sorted(self.senders), self.samples
            rule.solve_into_g()
            return
        if not self.senders:
            return
        st.stats = self.stats.copy() if st.stats is None else st.stats + self.stats
        st.contributors = sorted([*st.contributors, *self.senders])  # (sorted: the same however shards merged)
        st.samples += self.samples


class UpdateFold(Fold):
    """An update round of the route: each device's sparse update of g (top-K with error feedback), checked, then
    summed with weight |D_k| into a dense float64 numerator; the mean is applied to g where some upload had an
    entry. An empty update is a device that holds another version of g: nothing to add, and the next round
    message carries the whole g."""

    kinds = (Upload.ADAPTER,)
    # Not clipped: the route's semantics are the benchmark's (bench/predictor_routes.py), and a clipped-away part
    # of an update would be lost from the device's error-feedback residual. Checked instead: length, positions,
    # finiteness, at most K values.
    clip: Mapping[Part, Clip | None] = {Part.UPDATE: None}
    merged = ("num", "den", "hits", "senders", "behind")

    def __init__(self, rule: RidgeRule) -> None:
        self.rule = rule
        n = rule.length_g
        self.num = np.zeros(n)
        self.hits = np.zeros(n, np.int64)  # uploads that sent each entry (merged by adding)
        self.den = 0.0
        self.senders: list[str] = []
        self.behind: list[str] = []
        self.k = route_k(n, rule.topk)

    def check(self, up: ClippedUpload) -> Any:
        update = up.update
        assert update is not None
        rule = self.rule
        n = rule.length_g
        if update.n != n:
            more = ""
            if update.n == rule.length:
                more = f"; round {rule.current_round()} is an update round: statistics are sent every {rule.every}"
            raise WireError(f"ridge route update of length {update.n}, expected g's {n} values{more}")
        if update.indices is None:
            raise WireError(f"ridge route update sent dense; it travels as at most {self.k} sparse values")
        idx = update.indices
        if idx.size == 0:
            return ("behind", up.sender)
        if idx.size > self.k:
            raise WireError(f"ridge route update of {idx.size} values, at most K = {self.k} travel")
        if idx[0] < 0 or idx[-1] >= n or (idx.size > 1 and not (np.diff(idx) > 0).all()):
            raise WireError(f"ridge route update: indices must be sorted, unique and in range [0, {n})")
        vec = update.vector
        values = np.asarray(vec.values if isinstance(vec, SparseVector) else np.asarray(vec)[idx], np.float64)
        if values.shape != idx.shape or not np.isfinite(values).all():
            raise WireError("ridge route update: a value is not finite (or values and indices differ in number)")
        if up.n_samples <= 0:
            raise WireError("ridge route update with n_samples = 0")
        return idx, values, float(up.n_samples), up.sender

    def fold(self, prepared: Any) -> None:
        if isinstance(prepared[0], str):  # ("behind", sender)
            self.behind.append(prepared[1])
            return
        idx, values, w, sender = prepared
        self.num[idx] += w * values
        self.hits[idx] += 1
        self.den += w
        self.senders.append(sender)

    def partial(self) -> dict[str, Any]:
        _one_aggregator(self.rule)
        return {
            "num": self.num.copy(),
            "den": self.den,
            "hits": self.hits.copy(),
            "senders": list(self.senders),
            "behind": list(self.behind),
        }

    def merge(self, part: Mapping[str, Any], *, check: bool = False) -> None:
        if not isinstance(part, Mapping) or set(part) != set(self.merged or ()):
            raise ValueError(f"UpdateFold: partial has {sorted(part) if isinstance(part, Mapping) else part!r}")
        for name in ("num", "hits"):
            arr = part[name]
            if not isinstance(arr, np.ndarray) or arr.shape != self.num.shape or not np.isfinite(arr).all():
                raise ValueError(f"UpdateFold.{name}: expected a finite array of shape {self.num.shape}")
        if not is_number(part["den"]) or part["den"] < 0:
            raise ValueError("UpdateFold.den: expected a number >= 0")
        for name in ("senders", "behind"):
            names = part[name]
            if not isinstance(names, list) or not all(isinstance(s, str) for s in names):
                raise ValueError(f"UpdateFold.{name}: expected a list of client ids")
        if check:
            return
        self.num += part["num"]
        self.hits += part["hits"].astype(np.int64)
        self.den += float(part["den"])
        self.senders.extend(part["senders"])
        self.behind.extend(part["behind"])

    def finish(self) -> None:
        st = self.rule.state
        st.g_resync = bool(self.behind)
        if not self.senders or st.g is None:
            return  # g unchanged: the round message keeps announcing its last change
        mean = self.num / self.den
        st.g, sent = apply_update(st.g, mean, self.hits > 0)
        st.g_changed, st.g_values = sent.indices, np.asarray(sent.values, np.float32)
        st.g_version += 1
        st.g_updates = len(self.senders)
