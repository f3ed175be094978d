"""A device's side of one phase's secure aggregation (protofl/secagg.py; the server's is
broker_server/core/secagg_run.py).

The masking stage (`Masking`, a sealing stage: edge_agent/core/sealing.py) takes the upload as it would travel (every
technique's encoding, DP's noise, the plan's dtype: decoded back to the floats the server would have read). Instead
of that upload the device sends its two public keys and keeps the table; each server message then gets one answer:

    SaRoster     (its neighbours' keys, t, the ring)  -> SaShares  (its Shamir shares, encrypted to each)
    SaRouted     (the shares sent to it)              -> SaMasked  (its table vector, fixed point, masked mod 2^32,
                                                                    naming any neighbour whose box does not decrypt)
    SaSurvivors  (which neighbours sent a masked one) -> SaUnmask  (its shares of their seeds / of the others' keys)

The table vector is, per class, its row times its weight and the weight (`weighted`: n_kc, else 1 for a class it
sends, 0 for one it lacks), every value clipped to +-bound first: the unmasked sum gives each class's weighted row
sum and weight without telling which device sent which class. A FedAvg device (one dense parameter vector: the
adapter or the model) masks its vector times its sample count and the count (`params_vector`), FedAvg's weighted
sum and weight. An answer is kept, so that the same server message
again (after the server restarted) gets the same answer, never a second draw of masks or shares.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from edge_agent.core.outcome import Drop
from edge_agent.core.sealing import Answer, Outgoing, Stage
from protofl import privacy, secagg, wire
from protofl.plan import RoundPlan
from protofl.sparse import SparseVector
from protofl.wire import Envelope, Message, ParamsUpload, ProtoSet, ProtoUpload, decode_array, encode_array

log = logging.getLogger("protofl.edge")


def table_vector(ps: ProtoSet | None, num_classes: int, width: int, weighted: bool) -> np.ndarray:
    """Per class [row * w, w] for the classes of `ps` (w its count n_kc where `weighted`, else 1), zeros for the
    others; the rows as the server would have decoded them from the wire (the set's dtype), float64."""
    out = np.zeros((num_classes, width + 1), dtype=np.float64)
    if ps is None or not ps.classes.size:
        return out.reshape(-1)
    rows = decode_array(encode_array(ps.values, ps.dt), what="prototypes").astype(np.float64)
    if weighted and ps.counts is None:
        raise ValueError("secure aggregation: weighted prototypes need their counts n_kc")
    w = ps.counts.astype(np.float64) if weighted and ps.counts is not None else np.ones(ps.classes.size)
    out[ps.classes, :width] = rows * w[:, None]
    out[ps.classes, width] = w
    return out.reshape(-1)


def params_vector(upload: ParamsUpload) -> np.ndarray:
    """A dense parameter upload as FedAvg folds it, masked: [vector * n, n] (n its sample count), the vector as the
    server would have decoded it from the wire (the upload's dtype), float64. A sparse update is refused: its
    index set would tell which parameters moved (docs/privacy.md)."""
    if isinstance(upload.update, SparseVector):
        raise ValueError("secure aggregation masks dense parameter vectors; this upload is sparse (top-K)")
    v = decode_array(encode_array(upload.update, upload.dt), what="update").astype(np.float64)
    n = float(upload.n_samples)
    return np.concatenate([v * n, [n]])


class RosterRefused(secagg.SecAggError):
    """A roster this device does not take part with (`secagg.roster_problem`): it leaves the phase, telling the
    server why."""


class DeviceSecAgg:
    """One device's secure aggregation of one phase: the protocol's device half and its kept answers. It masks its
    prototype table (`table`) or, where it uploads a parameter vector, `vector` (`params_vector`)."""

    def __init__(
        self,
        client_id: str,
        fed: str,
        round_: int,
        phase: str,
        table: ProtoSet | None,
        vector: np.ndarray | None = None,
        absent: np.ndarray | None = None,
    ) -> None:
        self.id = client_id
        self.round, self.phase = round_, phase
        self.device = secagg.Device(client_id, secagg.context(fed, round_, phase))
        self.table = table
        self.vector = vector
        # distributed DP: the noise share of the rows of the classes it lacks (privacy.absent_noise)
        self.absent = absent
        self.answers: dict[str, Message] = {}  # server kind -> this device's answer
        self.roster: wire.SaRoster | None = None
        self.clipped = 0

    def keys(self) -> wire.SaKeys:
        k = self.device.advertise()
        return wire.SaKeys(c=k.c, s=k.s)

    def answer(self, msg: Message, num_classes: int, width: int) -> Message | None:
        """The answer to a server message of this phase (the kept one, where it came before); raises SecAggError
        or ValueError where it cannot answer (the step goes on without this device)."""
        kept = self.answers.get(msg.KIND)
        if kept is not None:
            return kept
        out: Message
        if isinstance(msg, wire.SaRoster):
            if self.id in msg.keys:
                raise secagg.SecAggError("the roster names this device among its own neighbours")
            refused = secagg.roster_problem(len(msg.keys), msg.t)
            if refused is not None:  # the threshold is the device's to judge, not the server's word (issue 58)
                raise RosterRefused(f"refused the secure-aggregation roster: {refused}")
            self.roster = msg
            keys = {v: secagg.Keys(c, s) for v, (c, s) in msg.keys.items()}
            boxes = self.device.share_keys(keys, msg.t)
            out = wire.SaShares(boxes=[boxes[v] for v in msg.order])  # the roster's order names each box's reader
        elif isinstance(msg, wire.SaRouted):
            roster = self.roster
            if roster is None:
                raise secagg.SecAggError("shares routed before the roster")
            sealed = dict(zip(self._named(msg.senders, "senders"), msg.boxes, strict=True))
            # A box that does not decrypt is named to the server, and this device stays in without that neighbour
            # (no pair mask with it, none of its shares): the server leaves one of the two out (secagg_run.py).
            bad = self.device.open_shares(sealed)
            for u in bad:
                log.warning(
                    "%s: round %d: the share from %s does not decrypt; naming it to the server and going on without it",
                    self.id,
                    self.round,
                    u,
                )
            sealed = {u: box for u, box in sealed.items() if u not in bad}
            if self.vector is not None:
                x = self.vector
            else:
                x = table_vector(self.table, num_classes, width, roster.weighted)
                if self.absent is not None:  # (zeros in the rows it sends; the weights untouched)
                    x = (x.reshape(num_classes, width + 1) + np.pad(self.absent, ((0, 0), (0, 1)))).reshape(-1)
            bound = roster.bound
            self.clipped = int(np.count_nonzero(np.abs(x) > bound))
            if self.clipped:
                log.warning(
                    "%s: secure aggregation clipped %d value(s) to +-secagg_bound %g (raise it if that is common)",
                    self.id,
                    self.clipped,
                    bound,
                )
            fp = secagg.FixedPoint(roster.frac_bits, bound, 1)
            y = self.device.masked_input(fp.encode(np.clip(x, -bound, bound)), sealed)
            out = wire.SaMasked(y=y, blame=[roster.order.index(u) for u in bad])
        elif isinstance(msg, wire.SaSurvivors):
            if wire.SaRouted.KIND not in self.answers:
                raise secagg.SecAggError("a survivors list before this device sent its masked input")
            given = self.device.unmask(self._named(msg.alive, "alive"))  # in the roster's order, as the server reads
            out = wire.SaUnmask(shares=[y.to_bytes(secagg.SHARE_BYTES, "big") for _, y in given.values()])
        else:
            return None
        self.answers[msg.KIND] = out
        return out

    def _named(self, positions: list[int], what: str) -> list[str]:
        """The ids at `positions` of this device's roster (SecAggError past its end)."""
        order = self.roster.order if self.roster is not None else []
        if positions and positions[-1] >= len(order):
            raise secagg.SecAggError(f"{what}: position {positions[-1]}, past the {len(order)} of the roster")
        return [order[p] for p in positions]


class Masking(Stage):
    """Secure aggregation as a sealing stage: a prototype or parameter upload stays here and its keys travel instead;
    the open phase's run (`DeviceSecAgg`) then answers the server's steps on this device's own topic. `absent_std`:
    distributed DP's noise share for the rows of the classes the device lacks (None: no DP, or local DP)."""

    STEPS = (wire.SaRoster, wire.SaRouted, wire.SaSurvivors)

    def __init__(self, plan: RoundPlan, absent_std: float | None = None) -> None:
        self.num_classes, self.width = plan.num_classes, plan.proto_width
        self.absent_std = absent_std
        self.run: DeviceSecAgg | None = None  # the open phase's

    def seal(self, up: Outgoing, rng: np.random.Generator) -> Outgoing:
        msg = up.msg
        if isinstance(msg, ProtoUpload):
            absent = None
            if self.absent_std is not None:
                have = msg.local.classes if msg.local is not None else np.zeros(0, dtype=np.int64)
                absent = privacy.absent_noise(self.num_classes, self.width, have, self.absent_std, rng)
            self.run = DeviceSecAgg(up.sender, up.fed, up.round, up.phase, msg.local, absent=absent)
        elif isinstance(msg, ParamsUpload):  # (differential privacy covers prototype uploads only)
            self.run = DeviceSecAgg(up.sender, up.fed, up.round, up.phase, None, vector=params_vector(msg))
        else:
            return up
        return dataclasses.replace(up, msg=self.run.keys())

    def answer(self, env: Envelope, msg: Message) -> Answer | None:
        """A step of the open phase's secure aggregation: this device's answer (the same one if it came before)."""
        if not isinstance(msg, self.STEPS):
            return None
        run = self.run
        if run is None or (env.round, env.phase) != (run.round, run.phase):
            why = f"{msg.KIND} for round {env.round}/{env.phase}: no secure aggregation of it here"
            return Answer(drop=Drop("stale", why))
        try:
            return Answer(reply=run.answer(msg, self.num_classes, self.width))
        except (secagg.SecAggError, ValueError) as exc:
            why = f"round {env.round}: {exc}; this device drops out of the phase's secure aggregation"
            return Answer(drop=Drop("secagg", why), leave=isinstance(exc, RosterRefused))
