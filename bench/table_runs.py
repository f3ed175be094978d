"""What `bench.paper_table` runs: the federations, their sizing per suite, every row (a method on
several seeds) and its command line.

A *federation* fixes the data side (clients, alpha, architectures) and, per suite, the sizing (rounds,
data fraction, test set, evaluation cadence); every method of a section runs on the same one, so data,
partition, model and seeds are identical and every method sees the same rounds.
A *row* is one method of a table, run once per seed (docs/algorithms.md, Evaluation > Statistics: >= 3
seeds, 5 (0-4) for the rows a goal is judged on; two rows compare paired by seed, `bench.paired`). A *run*
is one (row, seed): one `protofl-server simulate` call, one cached JSON file.
A *section* is one table (and one PNG): a list of rows, its own or rows of another setting shown again
(setting D compares the combined pipeline with the presets of A and B).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

SEEDS = (0, 1, 2)
TEST_SET_SIZE = 10_000  # Fashion-MNIST's official test set
GOAL_SEEDS = (0, 1, 2, 3, 4)  # the rows a goal is judged on
DATASET = "fashion-mnist"

# The five architectures of setting C, round-robin over the 20 clients. FedPAGR's fifth is ResNet18,
# ~3 s per training step on this CPU (11.2 M backbone parameters at 28x28 with a stride-1 stem): four
# ResNet18 clients would cost more than the whole rest of setting C. A second MLP (0.66 M parameters,
# ~10x faster than the CNN here) keeps five slots and the budget; it makes the mix less diverse
# (two MLP clients in five), which is stated in TABLE.md.
C_ARCHS = ("cnn", "mlp", "resnet8", "mobilenetv2", "mlp")


@dataclass(frozen=True)
class Federation:
    key: str
    clients: int
    alpha: float
    archs: tuple[str, ...] = ("cnn",)
    describe: str = ""


FEDERATIONS: dict[str, Federation] = {
    "A05": Federation("A05", 10, 0.5, ("cnn",), "10 clients, Dirichlet alpha=0.5, cnn"),
    "A100": Federation("A100", 10, 100.0, ("cnn",), "10 clients, Dirichlet alpha=100, cnn"),
    "B": Federation("B", 20, 0.1, ("cnn",), "20 clients, Dirichlet alpha=0.1, cnn"),
    "C": Federation(
        "C", 20, 0.1, C_ARCHS, "20 clients, Dirichlet alpha=0.1, archs " + ",".join(C_ARCHS) + " round-robin"
    ),
}


@dataclass(frozen=True)
class Sizing:
    rounds: int
    train_limit: int | None
    test_limit: int | None  # None: the whole 10,000-image test set
    eval_every: int  # local split (cheap): the accuracy curves
    test_every: int  # official test set (global, ensemble): the dear part, only where the table uses it
    clients: int | None = None  # test-only override of the federation's client count


# Per suite and federation. `full`: global and ensemble accuracy on the full test set at the final round
# (what the tables report), the local split every round (what the curves show). `quick` is a smoke run;
# `tiny` exists for the test only.
SIZING: dict[str, dict[str, Sizing]] = {
    "full": {
        "A05": Sizing(rounds=10, train_limit=6000, test_limit=None, eval_every=1, test_every=10),
        "A100": Sizing(rounds=10, train_limit=6000, test_limit=None, eval_every=1, test_every=10),
        "B": Sizing(rounds=10, train_limit=6000, test_limit=None, eval_every=1, test_every=10),
        "C": Sizing(rounds=15, train_limit=6000, test_limit=None, eval_every=1, test_every=15),
    },
    "quick": {k: Sizing(rounds=2, train_limit=2000, test_limit=500, eval_every=1, test_every=2) for k in FEDERATIONS},
    # test only: 3 clients everywhere (C uses its first three architectures), 1 round, tiny subsets
    "tiny": {
        k: Sizing(rounds=1, train_limit=400, test_limit=60, eval_every=1, test_every=1, clients=3) for k in FEDERATIONS
    },
}

SIZING_NOTE = """\
Sizing of `full` (why): one training step of the cnn (1.7 M parameters) costs ~50 ms per batch of 64 on
this 2-core CPU and mobilenetv2 ~5x more, so the whole 60,000-image training set for 50 rounds (the
papers' budget) would take days per setting and seed. Each run gets a seeded 10 % subset of the training
set instead (`--train-limit 6000`; 200 of it is the public set carved for every method, the rest is
partitioned, 75/25 train/held-out per client), 10 rounds for A, B and D, 15 for C. Global and ensemble
accuracy use the whole 10,000-image test set, scored once, at the final round (`--test-every` = rounds):
scoring 10,000 images costs ~6 s per cnn client here, so every-round scoring would cost more than the
training. Local accuracy (each client's held-out split, a few hundred images) is scored every round and
gives the curves. Local epochs, batch size, optimiser and model width are the config defaults (E=1,
batch 64, SGD lr 0.01, momentum 0.9, wd 1e-4, m=512): nothing is tuned per method. Accuracies are
therefore lower than the papers' (their sizing needs a GPU) and the comparison that matters is between
rows of one section (same data, partitions, models, seeds, rounds). How much lower, and how much of
that is the sizing rather than the metric, is measured in "Ours beside the papers' Fashion-MNIST
figures". The rows a goal is judged on run on seeds 0-4 with `--clip off`, beside a clipped twin on
seeds 0-2; every other row on seeds 0, 1 and 2 (a seed changes the partition, the initialisation and the
batch order). Every run asks for the whole test set explicitly (`--test-limit 10000`). The suite runs the
goals' rows first (all seeds of a row together, so a cut suite still has verdicts), then the local-only
controls, the default's ablation and the lambda sweep, then the rest; it is resumable and spans sessions."""


GPU_NOTE = """\
Ran in part, on 2026-11-26 (bench/results/GPU.md, `python -m bench.gpu_sizing`): setting A, alpha 0.5, at
RefProtoFL's sizing (the whole 60,000-image training set, our ResNet18, 10 clients, the whole test set,
`--clip off`, `--device cuda`) on the session's lent H200, seed 0, for fedavg, fedproto, refprotofl,
tinyproto and protofl. The session's 15 minutes of device time gave 13-25 of the 50 rounds, so the figures
are at round 10 and rest on one seed: fedproto's and refprotofl's *global* (the per-client head on the
test set) are 72.49 and 72.67 there, 1.3 and 1.5 points under the paper's 50-round 73.82 and 74.21, where
our CPU sizing gives 44.18 and 45.97. The CPU table's gap to RefProtoFL is therefore the sizing's, and the
paper's prototype figures are most likely this per-client metric. Our FedAvg's global model reaches 89.37
at round 10, far above the paper's 73.72; the prototype methods' ensembles lie within 1 point of it
(88.4-89.4) at 1/1,000 to 1/20,000 of its uplink bytes. Alpha 100, 50 rounds and seeds 1-4 are left for a
session with more device time (~20 minutes of H200 time for the five rows at one seed, 50 rounds)."""


@dataclass(frozen=True)
class Paper:
    """A figure from ALGORITHMS.md's reference list: its value and the paper's (different) setting."""

    ref: str  # key into PAPER_REFS
    local: str | None = None
    global_: str | None = None
    ensemble: str | None = None
    bytes_: str | None = None

    def text(self) -> str:
        parts = []
        if self.local:
            parts.append(f"local {self.local}")
        if self.global_:
            parts.append(f"global {self.global_}")
        if self.ensemble:
            parts.append(f"ens {self.ensemble}")
        if self.bytes_:
            parts.append(self.bytes_)
        return f"{', '.join(parts)} [{self.ref}]"


PAPER_REFS: dict[str, str] = {
    "R05": "RefProtoFL Table 2, FashionMNIST, alpha=0.5: Top-1 test accuracy, ResNet18, 10 clients, 50 rounds, "
    "full training set.",
    "R100": "RefProtoFL Table 2, FashionMNIST, alpha=100: Top-1 test accuracy, ResNet18, 10 clients, 50 rounds, "
    "full training set.",
    "T": "TinyProto Table (CIFAR-10, not Fashion-MNIST): accuracy and parameters sent per round; FedProto 82.90 at "
    "0.15 M vs TinyProto-FP (s=50) 84.52 at 0.02 M (about 7.5x fewer).",
    "P": "FedPAGR Table 1, Fashion-MNIST, alpha=0.1, 20 clients, 5 architectures (incl. ResNet18), full data: "
    "local / ensemble accuracy.",
    "Pabl": "FedPAGR ablation on CIFAR-10 (not Fashion-MNIST): change in ensemble accuracy vs full FedPAGR.",
}


# Why our figure and the paper's differ, per reference (the measured half is computed in TABLE.md).
PAPER_GAP_NOTES: dict[str, str] = {
    "R05": "RefProtoFL does not say how it scores a prototype method's test accuracy. Our *global* is each client's "
    "personalised model on the balanced test set, averaged over clients; FedAvg's is one model's in both. "
    "At our CPU sizing that per-client metric sits ~28 points under the paper; at the paper's own sizing "
    "(section 'Setting A at the papers' sizing, on a GPU', one seed, round 10 of 50) it is 72.5-72.7, "
    "1.3-1.5 under the paper: the gap is the sizing's, and the paper's figure is most likely this metric. "
    "FedAvg's small gap here is not the sizing's cost either way: our FedAvg is held near 70 % by the CPU "
    "sizing and reaches 89.4 at the paper's, while the paper's drops from 85 to 74 with heterogeneity.",
    "R100": "Near-IID clients: the per-client metric costs little (the prototype methods sit close to FedAvg), "
    "and what every method shares is the sizing's cost (10 % of the data, 10 rounds, a small cnn "
    "instead of ResNet18 for 50 rounds on the full training set).",
    "P": "FedPAGR's Table 1 uses the whole training set, ResNet18 as the fifth architecture and more rounds; ours "
    "10 % of the data, a second mlp and 15 rounds: every client model is weaker, and an average of 20 weak "
    "models trained on skewed labels loses more on the balanced test set than each does on its own split.",
}


@dataclass(frozen=True)
class Row:
    """One method of a table, run on every seed of `seeds`."""

    setting: str  # A, B, C, D, L: the cache directory
    name: str  # file name stem (the seed is appended)
    label: str  # the table's method column
    preset: str
    fed: str  # key of FEDERATIONS
    sets: tuple[tuple[str, Any], ...] = ()
    tier: int = 9  # suite order: the goals' rows first
    paper: Paper | None = None
    seeds: tuple[int, ...] = SEEDS
    confirm_tier: int | None = None  # the seeds after the first run at this tier (chosen on seed 0, confirmed later)
    # Upload clipping is a defence no paper has: off, so a paper's row is its method (docs/algorithms.md,
    # statistics); a row that measures what the defence costs sets it (`clipped_twin`), and so do the rows
    # not rerun since clipping became switchable (CLIPPED_ROWS: their cached runs ran clipped).
    clip: bool = False
    # The `--set` pairs its cached runs were made with, where they differ from `sets` but resolve to the same
    # config: runs made while the preset's default was the value `sets` now spells out (the cache still
    # checks the resolved config, `bench.paper_table.config_matches`). None: made as `sets` says.
    made_as: tuple[tuple[str, Any], ...] | None = None

    @property
    def key(self) -> str:
        return f"{self.setting}/{self.name}"

    def runs(self) -> list[Run]:
        return [Run(self, seed) for seed in self.seeds]


@dataclass(frozen=True)
class Run:
    """One (row, seed): one simulation, one cache file `<setting>/<row name>-s<seed>.json`."""

    row: Row
    seed: int

    @property
    def setting(self) -> str:
        return self.row.setting

    @property
    def name(self) -> str:
        return f"{self.row.name}-s{self.seed}"

    @property
    def key(self) -> str:
        return f"{self.setting}/{self.name}"

    @property
    def preset(self) -> str:
        return self.row.preset

    @property
    def fed(self) -> str:
        return self.row.fed

    @property
    def sets(self) -> tuple[tuple[str, Any], ...]:
        return self.row.sets

    @property
    def label(self) -> str:
        return f"{self.row.label}, seed {self.seed}"

    @property
    def tier(self) -> int:
        late = self.row.confirm_tier is not None and self.seed != self.row.seeds[0]
        return self.row.confirm_tier if late else self.row.tier  # type: ignore[return-value]


@dataclass(frozen=True)
class Section:
    setting: str
    key: str  # also the PNG's name
    title: str
    fed: str
    rows: tuple[str, ...]  # Row keys "setting/name", possibly of another setting
    notes: tuple[str, ...] = field(default_factory=tuple)


ROWS: list[Row] = []
SECTIONS: list[Section] = []

# Tiers (suite order). Within a tier, rows in the order below, every seed of a row together.
GOAL2, GOAL1, GOAL4, GOAL3, CONTROL, ABLATION, REST, SWEEP_CONFIRM = 1, 2, 3, 4, 5, 6, 7, 8
GOAL_TIERS = (GOAL1, GOAL2, GOAL3, GOAL4)
CLIPPED = " [clipped]"  # label suffix of a row whose runs clip uploads


def _add(*rows: Row, legacy: bool = True) -> list[str]:
    """Add rows; return their keys (each goal row followed by its clipped twin).

    A goal row (its tier is a goal's) runs unclipped on GOAL_SEEDS, and gets a clipped twin on SEEDS named
    `<name>-clipped`: what the defence costs, and the row whose runs are the ones cached before clipping
    could be switched off. `legacy` rows (every other row defined before `--clip off` existed) keep
    running clipped, so their cached runs stay valid; they say so in their label. New rows pass
    legacy=False and run as defined."""
    keys = []
    for row in rows:
        if row.tier in GOAL_TIERS:
            row = replace(row, seeds=GOAL_SEEDS, clip=False)
            twin = replace(
                row,
                name=f"{row.name}-clipped",
                label=row.label + CLIPPED,
                clip=True,
                seeds=SEEDS,
                tier=REST,
                paper=None,
            )
            ROWS.extend((row, twin))
            keys += [row.key, twin.key]
            continue
        if legacy:
            row = replace(row, clip=True, label=row.label + CLIPPED)
        ROWS.append(row)
        keys.append(row.key)
    return keys


def clipped(key: str) -> str:
    """The clipped variant of a row: its twin where it has one, else the row itself (a clipped row)."""
    twin = f"{key}-clipped"
    return twin if twin in {r.key for r in ROWS} else key


def _sets(**kw: Any) -> tuple[tuple[str, Any], ...]:
    return tuple(kw.items())


LOCAL_ONLY = "local only (control: fedproto at proto_lambda=0)"
PREDICTOR_LABEL = "refprotofl, frozen backbone (its global predictor)"


def _predictor_row(setting: str, name: str, fed: str) -> list[str]:
    """RefProtoFL with `backbone=frozen`: every device keeps the same seeded backbone, so the federated adapter
    and head on it are one model a new device can be given (the global predictor, broker_server/simulation/
    predictor.py). With the default `backbone=train` every backbone drifts apart and there is none: the
    simulate report says so, and its `predictor_acc` stays empty."""
    return _add(
        Row(setting, name, PREDICTOR_LABEL, "refprotofl", fed, _sets(backbone="frozen"), tier=CONTROL), legacy=False
    )


def _local_only(setting: str, name: str, fed: str) -> list[str]:
    """The local-only control of a federation (docs/algorithms.md, Evaluation): every client trains its own
    model on its own data for the same rounds and epochs, and nothing it receives changes its training.
    It is fedproto with the alignment weight 0: the cross-entropy alone trains, so the head, the backbone
    and the client's own prototypes are exactly those of a client that never federated (the prototypes
    still travel, so its byte columns and its nearest-*global*-prototype figures are not a control's)."""
    return _add(Row(setting, name, LOCAL_ONLY, "fedproto", fed, _sets(proto_lambda=0), tier=CONTROL), legacy=False)


# -- A: RefProtoFL Table 2 (alpha 0.5 also holds every preset, for D and goal 4) -----------------------
_a = _add(
    Row("A", "a0.5-fedproto", "fedproto", "fedproto", "A05", tier=GOAL2, paper=Paper("R05", global_="73.82")),
    Row("A", "a0.5-refprotofl", "refprotofl", "refprotofl", "A05", tier=GOAL2, paper=Paper("R05", global_="74.21")),
    Row("A", "a0.5-tinyproto", "tinyproto", "tinyproto", "A05", tier=GOAL4),
    Row("A", "a0.5-fedpagr", "fedpagr (single arch)", "fedpagr", "A05", tier=GOAL4),
    Row("A", "a0.5-fedavg", "fedavg", "fedavg", "A05", tier=ABLATION, paper=Paper("R05", global_="73.72")),
    Row(
        "A",
        "a0.5-refprotofl-no-erpa",
        "refprotofl w/o ERPA",
        "refprotofl",
        "A05",
        _sets(erpa=False, prototypes="none"),
        tier=REST,
    ),
    Row("A", "a0.5-refprotofl-no-apud", "refprotofl w/o APUD", "refprotofl", "A05", _sets(apud=False), tier=REST),
    Row(
        "A",
        "a0.5-refprotofl-no-both",
        "refprotofl w/o ERPA, w/o APUD",
        "refprotofl",
        "A05",
        _sets(erpa=False, prototypes="none", apud=False),
        tier=REST,
    ),
)
_a += _local_only("A", "a0.5-local-only", "A05")
_a += _predictor_row("A", "a0.5-refprotofl-frozen", "A05")
SECTIONS.append(Section("A", "A-alpha0.5", "A (RefProtoFL Table 2): alpha = 0.5", "A05", tuple(_a)))
_a100 = _add(
    Row("A", "a100-fedproto", "fedproto", "fedproto", "A100", tier=REST, paper=Paper("R100", global_="85.96")),
    Row("A", "a100-refprotofl", "refprotofl", "refprotofl", "A100", tier=REST, paper=Paper("R100", global_="85.76")),
    Row("A", "a100-fedavg", "fedavg", "fedavg", "A100", tier=REST, paper=Paper("R100", global_="85.10")),
)
_a100 += _local_only("A", "a100-local-only", "A100")
_a100 += _predictor_row("A", "a100-refprotofl-frozen", "A100")
SECTIONS.append(Section("A", "A-alpha100", "A (RefProtoFL Table 2): alpha = 100", "A100", tuple(_a100)))

# -- B: TinyProto (and every preset, for D and goal 4) -------------------------------------------------
_b = _add(
    Row(
        "B",
        "fedproto",
        "fedproto",
        "fedproto",
        "B",
        tier=GOAL1,
        paper=Paper("T", local="82.90", bytes_="0.15 M params/rnd"),
    ),
    Row(
        "B",
        "tinyproto",
        "tinyproto s=51 (m/10), mu=auto (preset)",
        "tinyproto",
        "B",
        tier=GOAL1,
        paper=Paper("T", local="84.52 (s=50)", bytes_="0.02 M params/rnd"),
    ),
    # Goal 1 at the paper's lambda = 1 (the config default, FedProto's weight), beside the preset's 0.1 (the
    # lambda sweep's choice, setting L). These runs were made while the tinyproto preset had lambda = 1, as
    # `B/tinyproto` (b48864a and ceb203e; clipped twins at 39dfef9 and 35ff888); f42cfe4 replaced them under
    # that name with the 0.1 runs, and they are restored here byte for byte from f42cfe4^.
    Row(
        "B",
        "tinyproto-lambda1",
        "tinyproto s=51 (m/10), mu=auto, proto_lambda=1 (the paper's)",
        "tinyproto",
        "B",
        _sets(proto_lambda=1.0),
        tier=GOAL1,
        made_as=(),
    ),
    Row("B", "refprotofl", "refprotofl", "refprotofl", "B", tier=GOAL4),
    Row("B", "fedpagr", "fedpagr (single arch)", "fedpagr", "B", tier=GOAL4),
    # Goal 4's shortfall taken apart: fedpagr differs from candidate (b) in two switches, the CPS masks and
    # refinement. This row is (b) without the masks (and fedpagr without refinement), so it splits the gap.
    Row(
        "B",
        "fedpagr-no-refine",
        "fedpagr w/o refinement (= (b) spherical CPS without the masks)",
        "fedpagr",
        "B",
        _sets(refine=False),
        tier=ABLATION,
    ),
    Row(
        "B",
        "tinyproto-mu-paper",
        "tinyproto s=51, mu=1.5e-4 (the paper's CIFAR-10 value)",
        "tinyproto",
        "B",
        _sets(mu=1.5e-4),
        tier=ABLATION,
    ),
    Row("B", "tinyproto-noscale", "tinyproto s=51, no scaling", "tinyproto", "B", _sets(scaling=False), tier=REST),
    Row("B", "tinyproto-s128", "tinyproto s=128 (m/4), mu=auto", "tinyproto", "B", _sets(cps_s=128), tier=REST),
)
_b += _local_only("B", "local-only", "B")
# FedAvg on B: the global model the global predictor is set against (the first suite had none in B).
_b += _add(Row("B", "fedavg", "fedavg", "fedavg", "B", tier=CONTROL), legacy=False)
_b += _predictor_row("B", "refprotofl-frozen", "B")
SECTIONS.append(
    Section(
        "B",
        "B",
        "B (TinyProto): 20 clients, alpha = 0.1",
        "B",
        tuple(_b),
        ("With scaling off, mu is unused (clients send plain prototypes and counts).",),
    )
)

# -- C: FedPAGR -----------------------------------------------------------------------------------------
_c = _add(
    Row("C", "fedproto", "fedproto", "fedproto", "C", tier=GOAL3, paper=Paper("P", local="95.53", ensemble="62.10")),
    Row(
        "C",
        "fedpagr",
        "fedpagr (head fixed during a round, Alg. 1)",
        "fedpagr",
        "C",
        tier=GOAL3,
        paper=Paper("P", local="95.96", ensemble="80.20"),
    ),
    Row(
        "C",
        "fedpagr-no-sep",
        "fedpagr w/o separation (lambda_s=0)",
        "fedpagr",
        "C",
        _sets(lambda_s=0),
        tier=GOAL3,
        paper=Paper("Pabl", ensemble="-2.7 pts"),
    ),
    Row(
        "C",
        "fedpagr-no-ent",
        "fedpagr w/o entropy (lambda_e=0)",
        "fedpagr",
        "C",
        _sets(lambda_e=0),
        tier=GOAL3,
        paper=Paper("Pabl", ensemble="-3.3 pts"),
    ),
    Row(
        "C",
        "fedpagr-train-head",
        "fedpagr, head also trained (pagr_train_head)",
        "fedpagr",
        "C",
        _sets(pagr_train_head=True),
        tier=REST,
    ),
)
_c += _local_only("C", "local-only", "C")
SECTIONS.append(
    Section(
        "C",
        "C",
        "C (FedPAGR): 20 clients, alpha = 0.1, five architectures",
        "C",
        tuple(_c),
        (
            "Fifth architecture: a second mlp instead of ResNet18 (ResNet18 costs ~3 s per training "
            "step here; four such clients would cost more than the rest of the setting).",
        ),
    )
)

# -- D: the combined pipeline's candidates, on A (alpha 0.5) and on B -------------------------------------
# Every row is `--preset protofl` with every switch of STAGE_KEYS spelled out, so it means the same run
# whatever the preset's default is; the default is chosen from them by `bench.table_report.decide_default`
# (DECISION_RULE), and goal 4 judges the candidate the preset resolves to.
STAGE_KEYS = ("federate", "prototypes", "consensus", "erpa", "apud", "cps", "cps_s", "scaling", "refine")
# Scaling is off in (a): with the public set on every class ERPA anchors every class with the public-set mean,
# so scaling has nothing to act on and the config refuses it (the runs made before the refusal are kept in
# D/refused/ and shown in their own table: identical to their scaling-free twins).
_A = dict(
    federate="adapter",
    prototypes="mean",
    consensus=False,
    erpa=True,
    apud=True,
    cps=True,
    cps_s=None,
    scaling=False,
    refine=False,
)
_SPHERICAL = dict(
    federate="none",
    prototypes="unit",
    consensus=True,
    erpa=False,
    apud=False,
    cps=True,
    cps_s=None,
    scaling=False,
    refine=False,
)
CANDIDATES: tuple[tuple[str, str, dict[str, Any]], ...] = (
    # (name suffix, label, switches): ALGORITHMS.md's candidates and the stage removals of (a).
    # (a) w/o CPS is ERPA + APUD, the refprotofl preset: its row is the baseline's.
    ("all", "(a) CPS + ERPA + APUD", _A),
    ("no-apud", "(a) w/o APUD (dense adapters)", {**_A, "apud": False}),
    ("no-erpa", "CPS + scaling + APUD (w/o ERPA)", {**_A, "erpa": False, "scaling": True}),
    ("no-cps", "ERPA + APUD (w/o CPS) = refprotofl", {**_A, "cps": False}),
    ("spherical", "(b) spherical CPS: FedPAGR's objective on CPS-masked unit prototypes", _SPHERICAL),
    ("spherical-refine", "(c) spherical CPS, s = m/4, + refinement", {**_SPHERICAL, "cps_s": 128, "refine": True}),
    (
        "spherical-erpa",
        "(d) spherical CPS + ERPA anchors from the public set, normalised",
        {**_SPHERICAL, "erpa": True},
    ),
)
# Candidates whose runs are another setting's rows (same federation, sizing, seeds and resolved stages):
# suffix -> {tag: row key}. Their D rows are not run twice.
CANDIDATE_ELSEWHERE: dict[str, dict[str, str]] = {"no-cps": {"a": "A/a0.5-refprotofl", "b": "B/refprotofl"}}


def candidate_row(tag: str, suffix: str) -> str:
    """The row key holding candidate `suffix` on federation tag 'a' (A) or 'b' (B)."""
    return CANDIDATE_ELSEWHERE.get(suffix, {}).get(tag, f"D/{tag}-{suffix}")


def decision_row(tag: str, suffix: str) -> str:
    """The row the default's decision reads for a candidate: its clipped variant, since every candidate has
    one (the decision was taken on runs that all clipped; the preset's candidate also runs unclipped for
    goal 4)."""
    return clipped(candidate_row(tag, suffix))


# Combinations measured before the config refused them (scaling + ERPA with every class public), each
# with the candidate it turned out identical to: (refused run suffix, label, switches, twin row key per tag).
REFUSED: tuple[tuple[str, str, dict[str, Any], dict[str, str]], ...] = (
    ("all", "CPS + scaling + ERPA + APUD", {**_A, "scaling": True}, {"a": "D/a-all", "b": "D/b-all"}),
    (
        "no-apud",
        "CPS + scaling + ERPA (dense adapters)",
        {**_A, "scaling": True, "apud": False},
        {"a": "D/a-no-apud", "b": "D/b-no-apud"},
    ),
    (
        "no-cps",
        "scaling + ERPA + APUD",
        {**_A, "scaling": True, "cps": False},
        {"a": "A/a0.5-refprotofl-clipped", "b": "B/refprotofl-clipped"},
    ),
)


def candidate_sets(switches: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """`--set` pairs for a candidate (None: the config default, so not set)."""
    return tuple((k, v) for k, v in switches.items() if v is not None)


def preset_stages() -> dict[str, Any]:
    """The switches of STAGE_KEYS `--preset protofl` resolves to at this revision."""
    from protofl.presets import make_config

    cfg = make_config("protofl")
    return {k: getattr(cfg, k) for k in STAGE_KEYS}


def preset_variant() -> str | None:
    """The suffix of the candidate `--preset protofl` equals (None: the preset is none of them)."""
    current = preset_stages()
    return next((s for s, _, sw in CANDIDATES if sw == current), None)


_preset_suffix = preset_variant()
for fed, tag, base, baselines in (
    ("A05", "a", "A", ("A/a0.5-fedproto", "A/a0.5-refprotofl", "A/a0.5-tinyproto", "A/a0.5-fedpagr")),
    ("B", "b", "B", ("B/fedproto", "B/refprotofl", "B/tinyproto", "B/fedpagr")),
):
    keys = _add(
        *(
            Row(
                "D",
                f"{tag}-{suffix}",
                label + (" = protofl preset" if suffix == _preset_suffix else ""),
                "protofl",
                fed,
                candidate_sets(switches),
                tier=GOAL4 if suffix == _preset_suffix else ABLATION,
            )
            for suffix, label, switches in CANDIDATES
            if suffix not in CANDIDATE_ELSEWHERE
        )
    )
    where = "A (alpha = 0.5, 10 clients)" if base == "A" else "B (alpha = 0.1, 20 clients)"
    shown = tuple(k for b in baselines for k in dict.fromkeys((b, clipped(b))))
    SECTIONS.append(
        Section(
            "D",
            f"D-{base}",
            f"D (combined) on {where}",
            fed,
            tuple(keys) + shown,
            (
                f"Rows marked 'from {base}' are the runs of setting {base} (same federation, sizing "
                "and seeds), not re-run.",
                "The candidate rows set every switch explicitly (" + ", ".join(STAGE_KEYS) + "), so "
                "they do not move when the preset's default does.",
                "(d) sends its public-set prototypes with the training upload (one phase, see "
                "protofl/plan.py): with nothing federated that equals ERPA's phase 1 of the next "
                "round; round 1 trains on FedPAGR's seeded random prototypes.",
            ),
        )
    )

# -- L: lambda sweep of the alignment term on A (alpha 0.5) ---------------------------------------------
# lambda = 1 is FedProto's and RefProtoFL's value: the erpa term's lambda = 1 row is refprotofl's own row of A
# (its clipped twin: every sweep row ran clipped, so the sweep compares like with like); the cps term's is a
# sweep row of its own, since this sweep moved tinyproto's default to 0.1 (the preset's row is that value).
# Chosen on seed 0, confirmed on seeds 1-2. CPS's grid reaches below 0.3, where its first sweep chose the edge.
LAMBDAS: dict[str, tuple[float, ...]] = {"erpa": (0.3, 3.0, 10.0), "cps": (0.03, 0.1, 0.3, 1.0, 3.0, 10.0)}
SWEEP: dict[str, tuple[str, str | None]] = {
    "erpa": ("refprotofl", "A/a0.5-refprotofl-clipped"),
    "cps": ("tinyproto", None),
}
for what, (preset, default_key) in SWEEP.items():
    keys = []
    for lam in LAMBDAS[what]:
        keys += _add(
            Row(
                "L",
                f"{what}-lambda{lam:g}",
                f"{preset}, proto_lambda={lam:g}",
                preset,
                "A05",
                _sets(proto_lambda=lam),
                tier=ABLATION,
                confirm_tier=SWEEP_CONFIRM,
            )
        )
    SECTIONS.append(
        Section(
            "L",
            f"L-{what}",
            f"lambda sweep: {preset} ({what.upper()} alignment) on A, alpha = 0.5",
            "A05",
            (*([default_key] if default_key else []), *keys),
            ("proto_lambda=1 is the preset's row of A (all seeds). Chosen on seed 0; the other seeds confirm.",)
            if default_key
            else ("Every lambda, 1 included, is a row of its own. Chosen on seed 0; the other seeds confirm.",),
        )
    )

ROW_BY_KEY: dict[str, Row] = {r.key: r for r in ROWS}
RUNS: list[Run] = [run for row in ROWS for run in row.runs()]
RUN_BY_KEY: dict[str, Run] = {r.key: r for r in RUNS}


def twin_run(run: Run) -> Run | None:
    """The run of a goal row's clipped twin on the same seed (None for other rows, or a seed the twin lacks)."""
    key = clipped(run.row.key)
    if key == run.row.key:
        return None
    twin = ROW_BY_KEY[key]
    return Run(twin, run.seed) if run.seed in twin.seeds else None


SETTINGS = ("A", "B", "C", "D", "L")

# The quick suite: the rows every goal needs, on seed 0 only (a smoke run, not evidence).
QUICK_TIERS = (GOAL1, GOAL2, GOAL3, GOAL4)


def suite_runs(suite: str) -> list[Run]:
    """The suite's runs in execution order: tier by tier, every seed of a row together."""
    ordered = sorted(RUNS, key=lambda r: r.tier)  # stable: rows in order, a row's seeds together
    if suite == "full":
        return ordered
    return [r for r in ordered if r.row.tier in QUICK_TIERS and r.seed == SEEDS[0]]


def needed_for(settings: set[str], runs: list[Run]) -> list[Run]:
    """Runs of `settings` plus the runs of other settings their sections show (D shows A's and B's)."""
    wanted_rows: set[str] = {r.row.key for r in runs if r.setting in settings}
    for sec in SECTIONS:
        if sec.setting in settings:
            wanted_rows.update(sec.rows)
    return [r for r in runs if r.row.key in wanted_rows]


def _set_value(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v)


def run_args(run: Run, suite: str, data_dir: str | None = None, as_made: bool = False) -> list[str]:
    """The CLI arguments of a run (after `protofl-server`), without --json; `as_made`: with the `--set` pairs
    its cached runs were made with (`Row.made_as`) instead of today's."""
    fed = FEDERATIONS[run.fed]
    size = SIZING[suite][run.fed]
    clients = size.clients if size.clients is not None else fed.clients
    args = [
        "simulate",
        "--preset",
        run.preset,
        "--dataset",
        DATASET,
        "--clients",
        str(clients),
        "--alpha",
        f"{fed.alpha:g}",
        "--rounds",
        str(size.rounds),
        "--seed",
        str(run.seed),
        "--arch",
        ",".join(fed.archs),
    ]
    if data_dir:
        args += ["--data-dir", data_dir]
    if size.train_limit is not None:
        args += ["--train-limit", str(size.train_limit)]
    # Always spelled out: the whole test set is what the table's test-set columns mean, whatever the
    # simulator's default becomes (a faster default may score a subset).
    args += ["--test-limit", str(size.test_limit if size.test_limit is not None else TEST_SET_SIZE)]
    args += ["--eval-every", str(size.eval_every), "--test-every", str(size.test_every)]
    for k, v in run.sets if not as_made or run.row.made_as is None else run.row.made_as:
        args += ["--set", f"{k}={_set_value(v)}"]
    return args + ["--clip", "on" if run.row.clip else "off", "-q"]


def spellings(run: Run, suite: str, data_dir: str | None = None) -> list[list[str]]:
    """The argument lists a cached run of `run` may hold: today's, and the one its runs were made with where
    the row says they were spelled otherwise (`Row.made_as`)."""
    today = run_args(run, suite, data_dir)
    if run.row.made_as is None:
        return [today]
    return [today, run_args(run, suite, data_dir, as_made=True)]


def as_spelled_today(args: list[str]) -> list[str]:
    """A cached run's arguments as today's `run_args` spells them. A run made before `--clip` existed ran with
    the simulator's default then, clipping on; one made without `--test-limit` scored the whole test set
    (the cache check also compares the report's `test_samples`)."""
    out = list(args)
    if "--test-limit" not in out and "--eval-every" in out:
        at = out.index("--eval-every")
        out[at:at] = ["--test-limit", str(TEST_SET_SIZE)]
    if "--clip" not in out:
        end = len(out) - 1 if out and out[-1] == "-q" else len(out)
        out[end:end] = ["--clip", "on"]
    return out


def test_samples(run: Run, suite: str) -> int:
    """How many test images the run's report must say it scored."""
    limit = SIZING[suite][run.fed].test_limit
    return TEST_SET_SIZE if limit is None else min(limit, TEST_SET_SIZE)
