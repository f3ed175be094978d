"""The simulation's report: per-round rows (accuracies, bytes, who took part) and the JSON document.

Accuracies come from the agents' `metrics` messages (`broker_server.core.progress.accuracies`, the same
summary the service logs); bytes come from the encoded messages the aggregator received and
published. numpy only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from broker_server.core.progress import RoundProgress, accuracies
from broker_server.core.shell import RoundRecord
from broker_server.core.stages import ServerModel
from broker_server.simulation.spec import SimulationSpec
from broker_server.simulation.timeline import LinkReport
from protofl import learning, privacy
from protofl.algorithms.robust import ClipCount
from protofl.config import FederationConfig
from protofl.plan import Phase
from protofl.schedule import scores_test_set
from protofl.wire import Metrics

log = logging.getLogger("protofl.simulate")


class Report:
    """Collects per-round metrics and byte counts, shows each round's row as soon as its metrics are in
    (`on_round`, driven by the runner's `poll`), and renders the JSON report.

    The runners wire the aggregator's `on_round_end` and `on_metrics` to the methods of the same name.
    `evaluate` (FedAvg) scores the aggregated parameter vector: the round's global accuracy."""

    def __init__(
        self,
        spec: SimulationSpec,
        cfg: FederationConfig,
        test_labels: np.ndarray,
        *,
        on_round: Callable[[dict[str, Any]], None] | None = None,
        evaluate: Callable[[np.ndarray], float] | None = None,
        predictor: Callable[[ServerModel], float | None] | None = None,
        predictor_info: tuple[str | None, str] = (None, ""),
    ) -> None:
        self.spec = spec
        self.cfg = cfg
        self.test_labels = test_labels
        self.evaluate = evaluate
        # The global predictor (broker_server/simulation/predictor.py): its test accuracy per scored round,
        # and its kind or the reason the config defines none.
        self.predictor = predictor
        self.predictor_info = predictor_info
        self.predictor_acc: dict[int, float] = {}
        self.metrics: dict[int, dict[str, Metrics]] = {}
        self.ens: dict[int, np.ndarray] = {}
        self.global_model_acc: dict[int, float] = {}
        self.metrics_bytes: dict[int, int] = {}
        self.records: list[RoundRecord] = []
        self.on_round = on_round
        self.progress = RoundProgress(self._show, eval_every=spec.eval_every, rounds=cfg.rounds)
        self.started = time.perf_counter()
        self.links: LinkReport | None = None  # set by a run over shaped links (--profiles)
        self.clips: dict[int, ClipCount] = {}  # per round: rows checked against the radius and clipped
        self.dp = privacy.resolve(cfg, cfg.draft)  # differential privacy: each row says the epsilon spent
        self.learning = learning.LearningWatch()  # protofl/learning.py: said once in the log, kept in the report

    def on_round_end(self, rec: RoundRecord, model: ServerModel) -> None:
        scored = scores_test_set(rec.round, self.spec.test_every, self.cfg.rounds)  # the official test set's rounds
        if self.evaluate is not None and scored:
            params = model.rules.round_fields(Phase.DONE).params  # the whole model's, where it is federated
            if params is not None:
                self.global_model_acc[rec.round] = self.evaluate(params)
        if self.predictor is not None and scored:
            acc = self.predictor(model)
            if acc is not None:
                self.predictor_acc[rec.round] = acc
        self.clips[rec.round] = ClipCount(checked=dict(rec.clip_checked), clipped=dict(rec.clipped))
        if self.clips[rec.round].checked:
            log.info("round %d: clipped %s", rec.round, self.clips[rec.round].text())
        self.records.append(rec)
        self.progress.round_end(rec)

    def on_metrics(self, client: str, round_: int, msg: Metrics, nbytes: int) -> None:
        self.progress.add_metrics(client, round_, msg)
        self.metrics.setdefault(round_, {})[client] = msg
        self.metrics_bytes[round_] = self.metrics_bytes.get(round_, 0) + nbytes
        if msg.probs is not None and msg.probs.shape[0] == len(self.test_labels):
            acc = self.ens.get(round_)
            self.ens[round_] = msg.probs.astype(np.float64) if acc is None else acc + msg.probs

    def poll(self, now: float, force: bool = False) -> None:
        """Show the rounds whose metrics are in (all closed rounds with `force`)."""
        self.progress.poll(now, force)

    def _show(self, rec: RoundRecord, metrics: dict[str, Metrics]) -> None:
        note = self.learning.update(self.round_row(rec))
        if note is not None:
            log.warning("the federation is %s", note)
        if self.on_round is not None:
            row = self.round_row(rec)
            if self.links is not None:
                row["sim_time_s"] = self.links.sim_time([r for r in self.records if r.round <= rec.round], self.metrics)
            self.on_round(row)

    def round_row(self, rec: RoundRecord, sim_time_s: float | None = None) -> dict[str, Any]:
        acc = accuracies(self.metrics.get(rec.round, {}).values())
        ens = None
        clips = self.clips.get(rec.round, ClipCount())
        if self.cfg.federate == "full":
            # FedAvg: global accuracy is the aggregated model's; it has no ensemble.
            acc["global_acc"] = self.global_model_acc.get(
                rec.round, self.predictor_acc.get(rec.round, acc["global_acc"])
            )
        elif rec.round in self.ens and len(self.test_labels):
            ens = float((self.ens[rec.round].argmax(1) == self.test_labels).mean())
        return {
            "round": rec.round,
            "local_acc": acc["local_acc"],
            "local_proto_acc": acc["local_proto_acc"],
            # nearest of each client's own prototypes (TinyProto's eq. 12), sample-weighted like local_acc
            "local_own_proto_acc": _pooled_extra(self.metrics.get(rec.round, {}).values(), "own_proto_correct"),
            "global_acc": acc["global_acc"],
            "global_proto_acc": acc["global_proto_acc"],
            "ensemble_acc": ens,
            "predictor_acc": self.predictor_acc.get(rec.round),
            "off_mask_energy": _weighted_extra(self.metrics.get(rec.round, {}).values(), "off_mask_energy"),
            "uplink_bytes": rec.uplink_bytes,
            "downlink_bytes": rec.downlink_bytes,
            "clients": len(rec.clients),
            "metrics_bytes": self.metrics_bytes.get(rec.round, 0),  # evaluation traffic, not uplink
            "closed_by": rec.closed_by,
            # rows (a class's prototype or anchor; a whole parameter vector) clipped and checked, per kind
            "clipped": dict(clips.clipped),
            "clip_checked": dict(clips.checked),
            **({"sim_time_s": sim_time_s} if self.links is not None else {}),
            **({"epsilon": self.dp.spent(rec.round)} if self.dp is not None else {}),
        }

    def to_json(self, dropped: dict[str, int]) -> dict[str, Any]:
        links = self.links.to_json(self.records, self.metrics) if self.links is not None else None
        sim = {r["round"]: r["sim_time_s"] for r in links["rounds"]} if links is not None else {}
        rows = [self.round_row(r, sim.get(r.round)) for r in self.records]
        return {
            "preset": self.cfg.preset,
            "config": self.cfg.to_dict(),
            "simulation": {
                "dataset": self.spec.dataset,
                "clients": self.spec.clients,
                "alpha": self.spec.alpha,
                "seed": self.spec.seed,
                "transport": self.spec.transport,
                "device": self.spec.device,
                "test_samples": int(len(self.test_labels)),
                "clip": "on" if self.spec.clip else "off",
                # the rounds that score the test set (None: the last only; protofl.schedule)
                "test_every": self.spec.test_every,
            },
            "rounds": rows,
            "totals": {
                "uplink_bytes": int(sum(r["uplink_bytes"] for r in rows)),
                "downlink_bytes": int(sum(r["downlink_bytes"] for r in rows)),
                "wall_s": round(time.perf_counter() - self.started, 3),
                "clipped": _sum_kinds(r["clipped"] for r in rows),
                "clip_checked": _sum_kinds(r["clip_checked"] for r in rows),
            },
            "dropped": dict(dropped),
            "predictor": {"kind": self.predictor_info[0], "reason": self.predictor_info[1]},
            # protofl/learning.py's verdict over the rounds (None: learning, or too few rounds to say)
            "learning": learning.verdict(rows),
            **({"links": links} if links is not None else {}),
        }


def _sum_kinds(counts: Iterable[Mapping[str, int]]) -> dict[str, int]:
    """Per-kind counts of every round added up."""
    total: dict[str, int] = {}
    for c in counts:
        for kind, n in c.items():
            total[kind] = total.get(kind, 0) + n
    return total


def _pooled_extra(metrics: Iterable[Metrics], key: str) -> float | None:
    """A per-client count of correct local predictions in `Metrics.extra`, pooled: sum / sum of local sizes."""
    pairs = [(m.extra[key], m.n_local) for m in metrics if key in m.extra]
    n = sum(w for _, w in pairs)
    return sum(v for v, _ in pairs) / n if n else None


def _weighted_extra(metrics: Iterable[Metrics], key: str) -> float | None:
    """A per-client figure of `Metrics.extra`, weighted by the clients' local split sizes (None if absent)."""
    pairs = [(m.extra[key], m.n_local) for m in metrics if key in m.extra and m.n_local]
    n = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / n if n else None


def describe_drops(aggregator: Mapping[str, int], agents: Mapping[str, Mapping[str, int]] | None) -> str:
    """Every side's dropped messages, by reason (and client), for an error that ends a run.

    `agents` is None where the agents' counts cannot be read (they run as separate processes)."""
    text = f"dropped by the aggregator: {dict(aggregator) or 'none'}"
    if agents is None:
        return text + "; the agents' drops are not counted here (separate processes)"
    by_client = {cid: dict(d) for cid, d in agents.items() if d}
    return text + f"; by the agents: {by_client or 'none'}"
