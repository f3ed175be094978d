"""Secure aggregation in the rounds: one open phase's SecAgg+ steps on the server, with no I/O (numpy only).

Where the config says `secagg` (docs/privacy.md), the training phase of a prototype-only federation (tinyproto,
fedproto), or of one dense parameter vector (fedavg: the adapter, or the model where the server knows its length;
each device masks its vector times its sample count, and the count), runs the steps of protofl/secagg.py before it
folds anything:

    keys      every expected device sends its two public keys (`SaKeys`, after its local training);
    shares    the server sends each its neighbours' keys (`SaRoster`), each sends its encrypted shares (`SaShares`);
    masked    the server routes each device the boxes addressed to it (`SaRouted`), each sends its masked table
              (`SaMasked`: per class its row times its weight, and the weight, in fixed point mod 2^32);
    unmask    the server names each survivor's surviving neighbours (`SaSurvivors`), each answers with its shares
              (`SaUnmask`); the server removes the masks and folds the SUM into the phase's prototype accumulator as a
              shard's partial sum would be merged (stages.PhaseRun.merge), then the phase finishes as always.

A step closes when every device still expected in it has sent its message, or at its deadline (the phase's
`round_timeout`, again for each step) with enough to go on; a device that drops (its grace ran out, it gave up) is
simply not waited for. Past the keys step no step waits longer (`SecAggClosing.overdue`): with too few at its
deadline the phase closes folding nothing, and the next round starts (a device restarted mid-phase takes part
there). A device that cannot open a neighbour's box names it in its masked input and stays in; when the masked
step closes, one of each such pair leaves the sum (`exclusions`: the named member where at least t neighbours
named it, else the accuser), treated as a device that dropped after its shares. An unmasked sum that the
survivors' clipped inputs cannot give is refused (`SecAggRun.out_of_range`), the global state kept. Every message
is an input of the round machine (rounds.py), journaled before it is applied, so a restart replays them into the
same steps; the graph's seed is a function of the config and the round (never the clock nor the OS's entropy), so
a replay draws the same graph. What the server holds until the unmask step closes is only masked vectors
(`SecAggRun.server.masked`).

What cannot combine is refused when the machine is built (`check`): server-side clipping and the robust means need
each upload in the clear, shards and site pre-aggregators would need the shares at every shard.

The round machine knows none of this: where the config says `secagg` it closes its phases with `SecAggClosing`
(a `closing.Closing`), which owns the messages above (their envelope checks and refusals, each dropped with its
reason), the steps and each step's deadline, and what the open phase's steps hold (nothing at a phase boundary,
where snapshots are taken; the journal replays the rest); once unmasked, the phase finishes as `FoldHere`'s.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from broker_server.core.closing import Closing, ClosingInput, Drop, FoldHere
from broker_server.core.stages import PhaseRun, ServerModel, build_model
from protofl import secagg, secagg_params, wire
from protofl.algorithms.robust import ClipPolicy
from protofl.config import FederationConfig
from protofl.errors import ConfigError
from protofl.mergeable import Additive
from protofl.plan import Phase, RoundPlan
from protofl.wire import Head, Message

if TYPE_CHECKING:
    from broker_server.core.rounds import Effect, Received, RoundMachine, Steer

log = logging.getLogger("protofl.server")

STEPS = ("keys", "shares", "masked", "unmask")
_STEP_OF = {wire.SaKeys: "keys", wire.SaShares: "shares", wire.SaMasked: "masked", wire.SaUnmask: "unmask"}
_SUM_SLOT = frozenset({"_sum", "_weight", "_senders"})  # a per-class prototype sum: fedproto's PrototypeAggregator
_VECTOR_SLOT = frozenset({"_num", "_den", "_count"})  # a weighted vector sum with one scalar weight: FedAvg's
KINDS = frozenset(c.KIND for c in wire.messages.SECAGG_MESSAGES)  # every secure-aggregation kind, the server's too
# the wire's sizes are the protocol's (the wire module imports no cryptography, so it states them again)
assert (wire.messages.SA_SHARE_BYTES, wire.messages.SA_BOX_BYTES) == (secagg.SHARE_BYTES, secagg.BOX_BYTES)


@dataclass(frozen=True)
class SumSlot:
    """Where the phase's sums live: the path of attributes to the accumulator, and its weighting; `dim` the length
    of a parameter vector's sum (FedAvg: the model or the adapter, each device's vector times its sample count
    and the count), or 0 for per-class prototype sums."""

    path: tuple[str, ...]
    weighted: bool
    dim: int = 0


def find_slot(run: PhaseRun) -> SumSlot:
    """The one per-class sum accumulator of the phase's folds (ConfigError if there is none, or more than one)."""
    found: list[SumSlot] = []

    def walk(obj: Any, path: tuple[str, ...]) -> None:
        if not isinstance(obj, Additive):
            return
        if set(obj.additive) == _SUM_SLOT:
            found.append(SumSlot(path, getattr(obj, "weighting", "mean") == "weighted"))
            return
        if set(obj.additive) == _VECTOR_SLOT and np.ndim(getattr(obj, "_den", ())) == 0:  # (not per-coordinate)
            found.append(SumSlot(path, True, int(getattr(obj, "dim", 0))))
            return
        for name in obj.additive:
            walk(getattr(obj, name), (*path, name))

    for i, fold in enumerate(run.folds):
        for name in getattr(fold, "merged", ()):
            walk(getattr(fold, name, None), (str(i), name))
    if len(run.folds) != 1 or len(found) != 1:
        raise ConfigError(
            f"secagg: the training phase's folds ({', '.join(type(f).__name__ for f in run.folds)}) are not one "
            "per-class sum of prototype rows and weights, nor one weighted sum of a dense parameter vector of a "
            "length the server knows (federate=adapter; the whole model only where the server has it: simulate), "
            "which is what secure aggregation unmasks"
        )
    return found[0]


def check(cfg: FederationConfig, run: PhaseRun, policy: ClipPolicy, *, sharded: bool) -> SumSlot:
    """Refuse, with the reason, what secure aggregation cannot combine with; else where its sums go."""
    if policy.robust != "mean":
        raise ConfigError(
            f"secagg: --robust {policy.robust} needs every upload's rows to take a coordinate-wise "
            f"{policy.robust}, and the server sees only their masked sum: use --robust mean with secagg"
        )
    if policy.enabled:
        raise ConfigError(
            "secagg: server-side clipping (the default) needs each upload's rows in the clear to clip them, and "
            "the server sees only their masked sum: pass --clip off (each device clips what it masks to "
            "+-secagg_bound, and to dp_clip with differential privacy)"
        )
    if sharded:
        raise ConfigError(
            "secagg: aggregator shards and site pre-aggregators fold uploads apart, and unmasking needs every "
            "share at one server: not wired yet; run one aggregator with secagg"
        )
    if cfg.select_target:
        raise ConfigError("secagg: over-selection (select_target) closes a phase at its first uploads: not with secagg")
    return find_slot(run)


def check_config(cfg: FederationConfig, policy: ClipPolicy, *, sharded: bool) -> SumSlot:
    """`check` before anything runs (`start`, `simulate`): on a server model of its own."""
    model = build_model(cfg, RoundPlan.from_config(cfg), policy)
    return check(cfg, PhaseRun(model, Phase.TRAIN), policy, sharded=sharded)


def graph_seed(cfg: FederationConfig, fed_context: bytes) -> bytes:
    """The neighbour graph's public seed for a phase: a function of the config's seed and the phase, so that a
    journal replay draws the same graph (the server picks the graph in any case: SecAgg+ trusts it for that)."""
    return hashlib.sha256(b"protofl-secagg graph\0" + str(cfg.seed).encode() + b"\0" + fed_context).digest()[:16]


def exclusions(blamed: Mapping[str, frozenset[str]], t: int) -> dict[str, str]:
    """Who leaves the sum over the masked step's accusations (accuser -> the neighbours whose boxes it could not
    open), with why. An accuser's masked input carries no pair mask with those it names, and the one it names
    still carries its mask with the accuser, so of every such pair one must leave the sum; the server cannot tell
    which box was bad. A member named by at least t of its neighbours (the threshold: a strict majority, more
    than the colluders the protocol already assumes) leaves; otherwise every accuser of a member that stays
    leaves instead, at its own cost, whatever the number it named: a lying member (or a few, fewer than t)
    excludes no one but itself, as if it had dropped, and a member that garbles its boxes to fewer than t
    neighbours costs the round those neighbours, as if they had dropped."""
    named_by: dict[str, set[str]] = {}
    for v, us in blamed.items():
        for u in us:
            named_by.setdefault(u, set()).add(v)
    out = {
        u: f"its shares do not decrypt at {len(vs)} neighbour(s) ({', '.join(sorted(vs))})"
        for u, vs in sorted(named_by.items())
        if len(vs) >= t
    }
    for v, us in sorted(blamed.items()):
        alone = sorted(us - set(out))
        if alone and v not in out:
            out[v] = f"it named {', '.join(alone)}, whom fewer than t = {t} neighbours named"
    return out


def describe(p: secagg_params.Params, threat: secagg_params.Threat | None) -> str:
    """k, t and what they give, in one line (`start`'s, and each round's where a threat model is stated)."""
    if p.n < secagg.MIN_NEIGHBOURS + 1:
        return (
            f"{p.n} device(s) give each fewer than {secagg.MIN_NEIGHBOURS} neighbours, which devices refuse: "
            f"secure aggregation needs at least {secagg.MIN_NEIGHBOURS + 1} devices a round"
        )
    d = 0.0 if threat is None else threat.dropout
    c = 0.0 if threat is None else threat.corrupt
    model = "fixed (no secagg_dropout stated)" if threat is None else f"from secagg_dropout={d:g}, secagg_corrupt={c:g}"
    target = secagg_params.TARGET if threat is None else threat.target
    met = "" if threat is None or p.meets else f"; the target 2^{math.log2(target):g} is out of reach with {p.n}"
    return (
        f"{p.n} devices -> k={p.k} neighbours, threshold t={p.t} ({model}); a round completes with probability "
        f">= {p.complete:.6f} at {100 * d:g}% dropout, leaks more than the sum with probability <= {p.exposed:.2g}{met}"
    )


def parameters_line(cfg: FederationConfig, n: int | None = None) -> str:
    """`describe` for a round of n devices (the config's min_clients where None: each round's k and t follow the
    devices that sent keys, at least that many)."""
    threat = secagg_params.stated(cfg.secagg_dropout, cfg.secagg_corrupt)
    n = cfg.min_clients if n is None else n
    return describe(secagg_params.for_round(n, threat), threat)


class SecAggRun:
    """The open training phase's secure aggregation: its step, the protocol's server half, the deadline's step."""

    def __init__(
        self, cfg: FederationConfig, proto_width: int, fed: str, round_: int, phase: Phase, slot: SumSlot
    ) -> None:
        self.cfg = cfg
        self.round = round_
        self.proto_width = proto_width
        self.slot = slot
        context = secagg.context(fed, round_, phase.value)
        self.server = secagg.Server(context, seed=graph_seed(cfg, context))
        self.step = STEPS[0]
        self.sent_shares: dict[str, dict[str, bytes]] = {}
        self.routed: dict[str, dict[str, bytes]] = {}
        self.fp: secagg.FixedPoint | None = None
        self.failed = ""  # why the phase closed without a sum ("" while it goes on, and once it unmasked)
        # accuser -> the neighbours whose routed boxes it could not open (its SaMasked named them), and the members
        # the masked step's close left out of the sum for it, with why (`exclusions`)
        self.blamed: dict[str, frozenset[str]] = {}
        self.excluded: dict[str, str] = {}
        self.params: secagg_params.Params | None = None  # k and t from the threat model, once the keys step closed

    @property
    def width(self) -> int:
        """The masked vector's length: per class a row and its weight, or a parameter vector and its weight."""
        return self.slot.dim + 1 if self.slot.dim else self.cfg.num_classes * (self.proto_width + 1)

    # -- inputs ---------------------------------------------------------------------------------------------
    def refusal(self, sender: str, msg: Message) -> tuple[str, str] | None:
        """Why `msg` from `sender` does not fit the open step, as (reason, detail); None if it does."""
        step = _STEP_OF.get(type(msg))
        if step is None:
            return "unexpected_kind", f"{type(msg).__name__} from {sender}: a device does not send it"
        if STEPS.index(step) < STEPS.index(self.step):
            return "stale", f"{msg.KIND} from {sender}: the {step} step is closed (now {self.step})"
        if step != self.step:
            return "wrong_phase", f"{msg.KIND} from {sender}: the {self.step} step is open, not {step}"
        if step != "keys" and sender not in self.took_part():
            return "stale", f"{msg.KIND} from {sender}, which was not in the step before when it closed"
        if sender in self.sent():
            return "duplicate", f"second {msg.KIND} from {sender}"
        problem = self._invalid(sender, msg)
        return None if problem is None else ("invalid", f"{msg.KIND} from {sender}: {problem}")

    def _invalid(self, sender: str, msg: Message) -> str | None:
        neighbours = self.server.graph.get(sender, frozenset())
        if isinstance(msg, wire.SaKeys):
            if msg.c == msg.s:
                return "its two keys must differ"
            if not secagg.usable_key(msg.c) or not secagg.usable_key(msg.s):
                return "a key that agrees no secret (a low-order point): every neighbour's share to it would fail"
        if isinstance(msg, wire.SaShares) and len(msg.boxes) != len(neighbours):
            return f"{len(msg.boxes)} boxes, not one for each of its {len(neighbours)} neighbours"
        if isinstance(msg, wire.SaMasked) and msg.y.shape[0] != self.width:
            return f"{msg.y.shape[0]} values, expected {self.width}"
        if isinstance(msg, wire.SaMasked) and msg.blame:
            order, routed = sorted(neighbours), self.routed.get(sender, {})
            if msg.blame[-1] >= len(order) or any(order[p] not in routed for p in msg.blame):
                return "it names a neighbour whose box was not routed to it"
        held = len(self.routed.get(sender, {})) - len(self.blamed.get(sender, ()))
        if isinstance(msg, wire.SaUnmask) and len(msg.shares) != held:
            return f"{len(msg.shares)} shares, not one for each of the {held} boxes routed to it"
        return None

    def apply(self, sender: str, msg: Message) -> None:
        s = self.server
        if isinstance(msg, wire.SaKeys):
            s.advertised(sender, secagg.Keys(msg.c, msg.s))
        elif isinstance(msg, wire.SaShares):  # one box a neighbour, in the roster's order
            self.sent_shares[sender] = dict(zip(sorted(s.graph[sender]), msg.boxes, strict=True))
        elif isinstance(msg, wire.SaMasked):
            s.received(sender, msg.y)
            if msg.blame:
                order = sorted(s.graph[sender])
                self.blamed[sender] = frozenset(order[p] for p in msg.blame)
        elif isinstance(msg, wire.SaUnmask):
            # one share a neighbour whose box was routed to it, in the roster's order; of its seed where that
            # neighbour is in the survivors list the server sent it, else of its mask key (the device's own rule)
            alive = s.graph[sender] & set(s.masked)
            held = sorted(set(self.routed.get(sender, {})) - self.blamed.get(sender, frozenset()))
            s.answered(
                sender,
                {
                    u: ("b" if u in alive else "s", int.from_bytes(y, "big"))
                    for u, y in zip(held, msg.shares, strict=True)
                },
            )

    # -- the steps ------------------------------------------------------------------------------------------
    def took_part(self) -> set[str]:
        """Who is in the open step: those who sent the step before's message (everybody for the keys step)."""
        s = self.server
        return {
            "keys": set(),
            "shares": set(s.keys),
            "masked": set(self.sent_shares),
            "unmask": set(s.masked),
        }[self.step]

    def sent(self) -> set[str]:
        s = self.server
        return {
            "keys": set(s.keys),
            "shares": set(self.sent_shares),
            "masked": set(s.masked),
            "unmask": set(s.answers),
        }[self.step]

    def waiting(self, expected: set[str]) -> set[str]:
        """The devices the open step still waits for, of those `expected` in the phase."""
        among = expected if self.step == "keys" else expected & self.took_part()
        return among - self.sent()

    def need(self, floor: int) -> int:
        """Devices a step needs to go on: at least `floor`, and enough that each has the neighbours a device accepts
        (secagg.MIN_NEIGHBOURS + 1 devices); with distributed DP at least min_clients, whose noise shares add up to the
        whole noise."""
        need = max(floor, secagg.MIN_NEIGHBOURS + 1)
        if self.cfg.dp_epsilon is not None and self.cfg.dp_mode == "distributed":
            need = max(need, self.cfg.min_clients)  # each device added 1/min_clients of the noise: never fewer
        return need

    def enough(self, floor: int) -> bool:
        """Whether the open step has enough to close (`need`; the unmask step: one answer, and the survivors the
        masked step's close left still enough)."""
        if self.step == "unmask":
            return bool(self.server.answers) and len(self.server.masked) >= self.need(floor)
        return len(self.sent()) >= self.need(floor)

    def out_of_range(self, sums: np.ndarray, weights: np.ndarray, senders: int) -> str:
        """Why an unmasked sum is not one that `senders` clipped inputs can give ("" if it can be): every value a
        device masks is within +-bound and every weight is >= 0 (an integer where the bound is one: counts, 0 or
        1, sample counts), so the sum's values are within +-senders * bound and its weights within [0, senders *
        bound] (within [0, senders] for unweighted prototypes); a row sum is at most bound times the devices
        that sent the class, and each of those weighs at least min(1, bound), so at most bound * weight /
        min(1, bound) (not with distributed DP, whose devices noise the rows of classes they lack). Masking cannot
        check an input that is in range and wrong; this catches garbage, which decodes anywhere in the ring."""
        assert self.fp is not None
        bound, n = float(self.cfg.secagg_bound), senders
        tol = n * self.fp.resolution  # each value is off by at most 2^-(f+1), a sum of n by n times that
        w = np.atleast_1d(np.asarray(weights, dtype=np.float64))
        rows = np.asarray(sums, dtype=np.float64).reshape(w.shape[0], -1)
        top = n if not self.slot.weighted and not self.slot.dim else n * bound
        if w.min(initial=0.0) < -tol or w.max(initial=0.0) > top + tol:
            return f"a weight sum of {w.min():.6g}..{w.max():.6g}, outside [0, {top:g}]"
        if bound.is_integer() and np.abs(w - np.rint(w)).max(initial=0.0) > tol:
            return "a weight sum that is no whole number (every device's weight is one)"
        if np.abs(rows).max(initial=0.0) > n * bound + tol:
            return f"a value of magnitude {np.abs(rows).max():.6g}, over {n} x the bound {bound:g}"
        if not (self.cfg.dp_epsilon is not None and self.cfg.dp_mode == "distributed"):
            limit = bound * np.minimum(n, np.maximum(w, 0.0) / min(1.0, bound)) + tol
            over = np.flatnonzero(np.abs(rows).max(axis=1) > limit)
            if over.size:
                where = f"class {over[0]}'s row" if not self.slot.dim else "the vector"
                return f"{where} over the bound times its weight"
        return ""

    def close_step(self, encode: Callable[[Message, str], Any]) -> list[Any]:
        """Close the open step: the next step's messages to each device, as `encode(message, client)` makes them
        (an empty list once unmasked: the caller folds `result()`)."""
        s = self.server
        if self.step == "keys":
            # (first: a ring too small for n values within +-bound raises before anything changed)
            self.fp = secagg.FixedPoint.for_sum(float(self.cfg.secagg_bound), len(s.keys))
            threat = secagg_params.stated(self.cfg.secagg_dropout, self.cfg.secagg_corrupt)
            if threat is not None:  # k and t from the stated threat model (else the fixed ones: the graph's own)
                self.params = secagg_params.derive(len(s.keys), threat)
                s.k, s.t = self.params.k, self.params.t
                log.info("round %d secure aggregation: %s", self.round, describe(self.params, threat))
            s.close_advertise()
            self.step = "shares"
        elif self.step == "shares":
            self.routed = s.route_shares(self.sent_shares)
            self.step = "masked"
        elif self.step == "masked":
            self.excluded = exclusions(self.blamed, s.threshold())
            s.cut = dict(self.blamed)
            for u in self.excluded:  # out of the sum: dropped after sharing, as far as the unmasking goes
                s.masked.pop(u, None)
            self.step = "unmask"
        else:
            raise AssertionError("the unmask step closes with result()")
        return self.again(encode)

    def again(self, encode: Callable[[Message, str], Any]) -> list[Any]:
        """The open step's messages, one a device (after a restart: again; a device that answered already sends
        the same answer, dropped as a duplicate). Every list in them follows the recipient's roster: its
        neighbours' ids, sorted."""
        s = self.server
        if self.step == "shares" and self.fp is not None:
            t = s.threshold()
            return [
                encode(
                    wire.SaRoster(
                        keys={v: (s.keys[v].c, s.keys[v].s) for v in sorted(s.graph[u])},
                        t=t,
                        frac_bits=self.fp.frac_bits,
                        bound=float(self.cfg.secagg_bound),
                        weighted=self.slot.weighted,
                    ),
                    u,
                )
                for u in sorted(s.graph)
            ]
        if self.step == "masked":
            out = []
            for u in sorted(s.shared):
                order, boxes = sorted(s.graph[u]), self.routed.get(u, {})
                senders = [i for i, v in enumerate(order) if v in boxes]
                out.append(encode(wire.SaRouted(senders=senders, boxes=[boxes[order[i]] for i in senders]), u))
            return out
        if self.step == "unmask":
            alive = set(s.masked)
            return [
                encode(wire.SaSurvivors(alive=[i for i, v in enumerate(sorted(s.graph[u])) if v in alive]), u)
                for u in sorted(alive)
            ]
        return []

    def result(self) -> tuple[np.ndarray, np.ndarray, int]:
        """The unmasked sum: per class the sum of the rows (times their weights) and of the weights (or the
        vectors' weighted sum and the weights' sum, a 0-d array), and the number of survivors. Raises SecAggError
        where too few shares came to unmask."""
        assert self.fp is not None
        total = self.fp.decode(self.server.unmask())
        if self.slot.dim:
            return total[: self.slot.dim], total[self.slot.dim :].reshape(()), len(self.server.masked)
        grid = total.reshape(self.cfg.num_classes, self.proto_width + 1)
        return grid[:, : self.proto_width], grid[:, self.proto_width], len(self.server.masked)


def fold_sum(run: PhaseRun, slot: SumSlot, sums: np.ndarray, weights: np.ndarray, senders: int) -> None:
    """Merge an unmasked sum into the phase's folds, as a shard's partial (stages.PhaseRun.merge)."""
    part = run.partial()
    for fold_part in [part["folds"][int(slot.path[0])]]:
        node: Mapping[str, Any] = fold_part
        for name in slot.path[1:]:
            node = node[name]
        if slot.dim:
            assert isinstance(node, dict) and set(node) == _VECTOR_SLOT
            node["_num"] = np.asarray(sums, dtype=np.float64)
            node["_den"] = float(weights)
            node["_count"] = int(senders)
            continue
        assert isinstance(node, dict) and set(node) == _SUM_SLOT
        present = weights > 0.5  # a class nobody sent sums to zero weight (within the ring's tolerance)
        node["_sum"] = np.where(present[:, None], sums, 0.0).astype(np.float64)
        node["_weight"] = np.where(present, weights, 0.0).astype(np.float64)
        node["_senders"] = int(senders)
    run.merge(part)


class SecAggClosing(Closing):
    """Secure aggregation as the round machine's closing (closing.Closing): the training phase runs the SecAgg+
    steps on the messages of `KINDS`, each step closing when every device still in it answered (or at its deadline
    with enough), and the last one folds the unmasked sum here; every other phase closes as `FoldHere`'s."""

    kinds = KINDS

    def __init__(self, cfg: FederationConfig, model: ServerModel, policy: ClipPolicy, *, fed: str, sharded: bool):
        # Refused here, with the reason, where secure aggregation cannot combine (`check`).
        self.slot = check(cfg, PhaseRun(model, Phase.TRAIN), policy, sharded=sharded)
        self.fed = fed  # the federation's name: what binds the phase's keys to it (secagg.context)
        self.fold = FoldHere()  # how the phase finishes once unmasked, and every other phase
        self.run: SecAggRun | None = None  # the open training phase's steps

    def begin(self, machine: RoundMachine) -> None:
        open_ = machine.phase
        self.run = None
        if open_ is not None and open_.phase is Phase.TRAIN:
            self.run = SecAggRun(machine.cfg, machine.plan.proto_width, self.fed, machine.round, Phase.TRAIN, self.slot)

    # -- its messages -----------------------------------------------------------------------------------------
    def screen(self, machine: RoundMachine, head: Head) -> None:
        """The checks of a secure-aggregation message that its envelope decides."""
        s, open_ = machine.state, machine.phase
        if head.sender not in s.clients:
            raise Drop("unknown_client", f"'{head.sender}' sent {head.kind} without joining")
        if self.run is None or open_ is None:
            raise Drop("unexpected_kind", f"{head.kind} from {head.sender}: no secure aggregation is open")
        if (head.round, head.phase) != (s.round, open_.phase.value):
            raise Drop(
                "stale", f"{head.kind} for round {head.round}/{head.phase} from {head.sender}; now round {s.round}"
            )
        if head.sender not in open_.expected:
            raise Drop("not_selected", f"{head.kind} from {head.sender}, who is not expected in round {s.round}")

    def accepts(self, machine: RoundMachine, inp: ClosingInput | Received) -> bool:
        if isinstance(inp, ClosingInput):
            return self.fold.accepts(machine, inp)
        self.screen(machine, inp.env)
        assert self.run is not None
        no = self.run.refusal(inp.env.sender, inp.msg)
        if no is not None:
            raise Drop(*no)
        return True

    def apply(self, machine: RoundMachine, inp: ClosingInput | Received) -> list[Effect]:
        if isinstance(inp, ClosingInput):
            return self.fold.apply(machine, inp)
        env, msg, open_ = inp.env, inp.msg, machine.phase
        assert self.run is not None and open_ is not None
        self.run.apply(env.sender, msg)
        if isinstance(msg, wire.SaMasked):  # its upload of the phase: what the round record counts
            open_.received[env.sender] = open_.received.get(env.sender, set()) | set(open_.needs)
        machine.state.current.uplink_bytes += inp.nbytes
        machine.count_upload(env, inp.nbytes)
        return self._progress(machine)

    def announce(self, machine: RoundMachine) -> list[Effect]:
        """After a restart: the open step's messages again."""
        again: list[Effect] = [] if self.run is None else list(self.run.again(self._steer(machine)))
        return again + self.fold.announce(machine)

    # -- the steps ----------------------------------------------------------------------------------------------
    def progress(self, machine: RoundMachine) -> list[Effect] | None:
        return None if self.run is None else self._progress(machine)

    def ready(self, machine: RoundMachine) -> list[str] | None:
        """At the deadline: the open step closes with enough to go on."""
        if self.run is None:
            return None
        return sorted(self.run.sent()) if self.run.enough(machine.floor) else []

    def overdue(self, machine: RoundMachine) -> bool:
        """Past the keys step a step takes no one new (a device restarted mid-phase is stale until the next phase),
        so waiting past its deadline cannot help: it closes, going on with enough or closing the phase."""
        return self.run is not None and self.run.step != "keys"

    def close(self, machine: RoundMachine, why: str) -> list[Effect]:
        return self.fold.close(machine, why) if self.run is None else self._close_step(machine, why)

    def _progress(self, machine: RoundMachine) -> list[Effect]:
        """Close the open step once every device still expected in it sent its message."""
        open_, sa = machine.phase, self.run
        assert open_ is not None and sa is not None
        if sa.waiting(open_.expected) or not sa.enough(machine.floor):
            return []
        return self._close_step(machine, "quorum")

    def _steer(self, machine: RoundMachine) -> Callable[[Message, str], Steer]:
        open_ = machine.phase
        assert open_ is not None
        phase = open_.phase
        return lambda msg, client: machine.steer(client, msg, phase)

    def _close_step(self, machine: RoundMachine, why: str) -> list[Effect]:
        """The open step closes (`why`: quorum or deadline): the next step's messages, each step with a deadline of
        its own, or the unmasked sum folded and the phase closed."""
        open_, sa, run, r = machine.phase, self.run, machine.run, machine.round
        assert open_ is not None and sa is not None and run is not None
        step = sa.step
        if not sa.enough(machine.floor):  # (a deadline: `overdue`) too few to go on, and no one new can come
            have = len(sa.server.masked) if step == "unmask" and sa.server.answers else len(sa.sent())
            return self._fail(machine, why, f"the {step} step has {have} device(s), {sa.need(machine.floor)} needed")
        if step != "unmask":
            took = len(sa.sent())
            steers: list[Steer] = sa.close_step(self._steer(machine))
            for u, reason in sorted(sa.excluded.items()):
                open_.received.pop(u, None)  # (what the round record counts: it is not in the sum)
                log.warning("round %d secure aggregation: %s is left out of the sum: %s", r, u, reason)
            if step == "masked" and len(sa.server.masked) < sa.need(machine.floor):
                return self._fail(machine, why, f"{len(sa.server.masked)} device(s) left in the sum after exclusions")
            machine.state.current.downlink_bytes += sum(len(e.payload) for e in steers)
            open_.deadline = machine.clock() + machine.cfg.round_timeout
            log.info(
                "round %d secure aggregation: %s step closed (%s) with %d device(s); now %s",
                r,
                step,
                why,
                took,
                sa.step,
            )
            return [*steers, *self._progress(machine)]
        try:
            sums, weights, senders = sa.result()
        except (secagg.SecAggError, ValueError) as exc:
            return self._fail(machine, why, f"could not unmask ({exc})")
        wrong = sa.out_of_range(sums, weights, senders)
        if wrong:
            return self._fail(
                machine,
                why,
                f"the unmasked sum of {senders} device(s) is not one their clipped inputs can give: {wrong}",
            )
        fold_sum(run, sa.slot, sums, weights, senders)
        log.info("round %d secure aggregation: unmasked the sum of %d device(s)", r, senders)
        self.run = None
        return self.fold.close(machine, why)

    def _fail(self, machine: RoundMachine, why: str, reason: str) -> list[Effect]:
        """The phase closes folding nothing (its global state kept), and the next phase or round starts."""
        assert self.run is not None
        self.run.failed = reason
        log.warning(
            "round %d secure aggregation: %s; the phase closes without folding (the global state is kept)",
            machine.round,
            reason,
        )
        self.run = None
        return self.fold.close(machine, why)
