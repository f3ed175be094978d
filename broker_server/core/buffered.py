"""Buffered asynchronous rounds (FedBuff; Nguyen et al., "Federated Learning with Buffered Asynchronous
Aggregation", AISTATS 2022), for the round machine (numpy only, no I/O).

With `buffer_k = K` (protofl/participation.py) a "round" is a version of the global state. The server folds
uploads as they arrive, into the open version's phase, and publishes a new global state (the next round message)
once K uploads are folded - or once every member has sent, where fewer than K are members - or at the deadline
with at least `min_clients`. No round waits for the slowest link: a device still training an older version
uploads when it is done, and its upload is folded into whatever version is open then:

    staleness s = open version - the version it was trained from (the envelope's round)
    s = 0:                     folded as every upload of a synchronous round
    0 < s <= staleness_bound:  folded with weight w(s) = 1 / sqrt(1 + s)
    s > staleness_bound:       dropped as `stale`

"Weight w" means the upload counts w times what it counts in a synchronous round: its sample count (FedAvg's and
the sparse adapter updates' weighted means) and its per-class counts (FedProto's n_kc-weighted mean) are multiplied
by w; a prototype set that travels without counts (TinyProto's scaled sums n_kc p_kc, summed and divided by the
senders; FedPAGR's unit prototypes, summed and normalised) has its rows multiplied by w. One device may so land
twice in a version (a stale upload and its fresh one); the same (device, version) upload twice is a duplicate, as
always.

Crash-exact like the synchronous path: the version is the round counter (state), a stale upload's weight is a
function of the state and its envelope, and the journal replays the open version's uploads to the same sums.
Needs a plan of one phase (the device trains and uploads once per version) and one aggregator (no shards).
"""

from __future__ import annotations

from protofl.config import FederationConfig
from protofl.errors import ConfigError
from protofl.participation import staleness_weight
from protofl.plan import RoundPlan


class Buffered:
    """The machine's asynchronous policy: which uploads an open version takes, at what weight, and when it is full."""

    def __init__(self, cfg: FederationConfig, plan: RoundPlan, sharded: bool) -> None:
        self.k = cfg.buffer_k
        self.bound = cfg.staleness_bound
        self.active = self.k > 0
        if self.active and len(plan.phases) != 1:
            phases = ", ".join(p.value for p in plan.phases)
            raise ConfigError(
                f"buffer_k (asynchronous rounds) needs a plan of one phase; {cfg.preset} has {phases}: switch off "
                f"the phase before training (its technique's switch, --set NAME=false) or run synchronous rounds "
                f"(buffer_k=0)"
            )
        if self.active and sharded:
            raise ConfigError("buffer_k (asynchronous rounds) runs on one aggregator: drop --shards")

    def staleness(self, open_round: int, upload_round: int) -> int:
        return open_round - upload_round

    def takes(self, open_round: int, upload_round: int) -> bool:
        """Whether an upload trained from `upload_round` is folded into the open version (else it is stale)."""
        return self.active and 0 < open_round - upload_round <= self.bound

    @staticmethod
    def key(sender: str, open_round: int, upload_round: int) -> str:
        """Where the open phase records an upload: its sender; a stale one under sender@version."""
        return sender if upload_round == open_round else f"{sender}@{upload_round}"

    def weight(self, open_round: int, upload_round: int) -> float:
        return staleness_weight(open_round - upload_round)

    def full(self, done: int) -> bool:
        return self.active and done >= self.k
