"""A device's local checkpoint (`protofl-edge join --state-dir DIR`): what it needs to resume mid-federation.

After every round message it handled, the runner saves (atomically, fsynced; protofl/checkpoint.py, no
pickle) the model's weights (the private backbone is trained across rounds and exists nowhere else), the
round state the agent keeps between rounds, the rounds it handled, and the uploads it sent for the last
one. A device restarted mid-round loads it once the federation's config is known, and the retained round
message does the rest: a round it had already handled gets its uploads sent again (the aggregator drops
those it holds); a round it had not finished is trained from the saved state, which is the state an
uninterrupted device would train it from, so it produces the same upload. A checkpoint of another
federation config (or a damaged one) is not used: the device starts fresh and says so.

`LocalState` is what the runner keeps on the device's own disk: this checkpoint, and the deployable artifacts
(edge_agent/core/artifacts.py; by default under STATE_DIR/artifacts).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from edge_agent.core.agent import EdgeAgent
from edge_agent.ops.local_data import DataSpec, dataset_spec
from protofl.checkpoint import CheckpointError, read_checkpoint, write_checkpoint
from protofl.config import FederationConfig, canonical
from protofl.errors import ConfigError

if TYPE_CHECKING:
    from edge_agent.core.artifacts import DeviceArtifacts

log = logging.getLogger("protofl.edge")
FORMAT = 2  # 2: the techniques' state per rule, and the round's dense targets


def checkpoint_path(state_dir: Path | str, fed: str, client_id: str) -> Path:
    return Path(state_dir) / f"{fed}-{client_id}.ckpt"


def save_agent(path: Path, agent: EdgeAgent, key: tuple[int, str] | None, sent: list[tuple[str, bytes]]) -> None:
    assert agent.cfg is not None and agent.model is not None
    write_checkpoint(
        path,
        {
            "format": FORMAT,
            "cfg": agent.cfg.to_dict(),
            "model": {k: v.detach().cpu().numpy() for k, v in agent.model.state_dict().items()},
            "global_adapter": agent.global_adapter,
            "adapter_round": agent.adapter_round,
            "targets": [[int(c), np.asarray(v)] for c, v in sorted(agent.targets_table.items())],
            "rules": {rule.name: rule.state() for rule in agent.rules},
            "handled": sorted([r, p] for r, p in agent.handled),
            "rounds_trained": agent.stats.rounds_trained,
            "key": None if key is None else list(key),
            "sent": [[t, p] for t, p in sent],
        },
    )


def restore_agent(path: Path, agent: EdgeAgent) -> tuple[tuple[int, str] | None, list[tuple[str, bytes]]] | None:
    """Load the checkpoint into `agent` (built, config applied); (last key, its uploads), or None if there
    is none to use (missing, damaged or of another config: logged, and the device starts fresh)."""
    assert agent.cfg is not None and agent.model is not None
    try:
        state = read_checkpoint(path)
    except CheckpointError as exc:
        log.error("%s: %s; starting this device fresh", agent.client_id, exc)
        return None
    if state is None:
        return None
    if state.get("format") != FORMAT or not _same_config(state.get("cfg"), agent.cfg):
        log.warning("%s: %s is from another federation config; starting fresh", agent.client_id, path)
        return None
    try:
        agent.model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in state["model"].items()})
    except (RuntimeError, KeyError, TypeError) as exc:
        log.error("%s: %s does not fit this model (%s); starting fresh", agent.client_id, path, exc)
        return None
    agent.global_adapter = state["global_adapter"]
    agent.adapter_round = int(state["adapter_round"])
    rules = state.get("rules", {})
    for rule in agent.rules:
        rule.load_state(rules.get(rule.name, {}))
    # The round's objective, rebuilt from its dense targets (the head keeps the saved weights).
    agent.objective = agent.make_objective({int(c): np.asarray(v) for c, v in state["targets"]}, fresh=False)
    agent.handled = {(int(r), str(p)) for r, p in state["handled"]}
    agent.stats.rounds_trained = int(state["rounds_trained"])
    key = None if state["key"] is None else (int(state["key"][0]), str(state["key"][1]))
    log.info(
        "%s: resumed from %s (%d round(s) trained, last handled %s)",
        agent.client_id,
        path,
        agent.stats.rounds_trained,
        key,
    )
    return key, [(str(t), bytes(p)) for t, p in state["sent"]]


class LocalState:
    """The checkpoints (under `state_dir`, one per federation or fleet run: `key`) and the deployable artifacts
    (under `artifacts`, else STATE_DIR/artifacts) of device `client_id`; None: not kept."""

    def __init__(self, client_id: str, data: DataSpec, state_dir: str | None, artifacts: str | None) -> None:
        self.client_id, self.data, self.state_dir = client_id, data, state_dir
        self.artifacts_dir = (
            artifacts if artifacts is not None or state_dir is None else str(Path(state_dir) / "artifacts")
        )
        self.class_names: list[str] | None = None  # the federation's class names, as its artifacts say them

    def save(self, agent: EdgeAgent, key: str) -> None:
        """The agent's state now (a round message was handled), before what it sent for it leaves."""
        if self.state_dir is not None:
            save_agent(
                checkpoint_path(self.state_dir, key, self.client_id),
                agent,
                agent.last_key,
                [(s.topic, s.payload) for s in agent.sent],
            )

    def resume(self, agent: EdgeAgent, key: str) -> None:
        """Pick up our own last local state, once the config built the agent's model."""
        if self.state_dir is None:
            return
        got = restore_agent(checkpoint_path(self.state_dir, key, self.client_id), agent)
        if got is not None:
            agent.restore_sent(*got)  # the last round message handled, and the uploads sent for it

    def name_classes(self, cfg: FederationConfig) -> None:
        """The federation's class names, for its artifacts (where this device writes any)."""
        if self.artifacts_dir is not None:
            from protofl.data.classnames import class_names

            self.class_names = class_names(dataset_spec(self.data.data), cfg.num_classes)

    def deploy(self, arts: DeviceArtifacts) -> None:
        """Write this device's deployable artifacts (edge_agent/core/artifacts.py); a failure is logged, not fatal:
        the federation needs the device more than the files."""
        if self.artifacts_dir is None:
            return
        try:
            where = arts.write(self.artifacts_dir, self.class_names, data=dataset_spec(self.data.data))
        except (OSError, ValueError) as exc:  # a full disk, an unreadable classes file: said, never a lost round
            log.error("%s: could not write its artifacts to %s: %s", self.client_id, self.artifacts_dir, exc)
            return
        log.info("%s: deployable artifacts in %s (%d round(s) trained)", self.client_id, where, arts.rounds_trained)


def _same_config(saved: Any, cfg: FederationConfig) -> bool:
    """A checkpoint's config is this federation's (a flat one, saved before the scoped config, read as today's)."""
    if not isinstance(saved, dict):
        return False
    if saved == cfg.to_dict():
        return True
    try:
        return canonical(saved) == cfg.to_dict()
    except (ConfigError, TypeError, AttributeError):
        return False
