"""`simulate --out DIR`: the run's deployable artifacts (layout: protofl/artifacts.py).

The federation's (DIR/manifest.json, DIR/global/) come from the server's final model; every device writes
its own (DIR/devices/<id>/) when it sees the final round message: in-process from the outcome the agent
returns for it, over MQTT as `protofl-edge join --artifacts DIR` does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from broker_server.core.artifacts import write_server_artifacts
from broker_server.core.shell import Aggregator
from broker_server.simulation.spec import FED, Federation, SimulationSpec
from protofl.data.classnames import class_names

if TYPE_CHECKING:
    from edge_agent.core.artifacts import DeviceArtifacts

__all__ = ["DEVICE_ARTIFACTS", "device_hook", "join_artifact_args", "write_run_artifacts"]
# When a simulated device's agent collects its deployable artifacts (where the run keeps them): at the end only.
DEVICE_ARTIFACTS: tuple[Literal["final"]] = ("final",)


def device_hook(spec: SimulationSpec, num_classes: int) -> Callable[[DeviceArtifacts], None] | None:
    """What an in-process device does with the artifacts its agent's outcome carries (agents built with
    `artifacts_at=DEVICE_ARTIFACTS`): write them once the federation finished (None without --out)."""
    if spec.out_dir is None:
        return None
    out, names = spec.out_dir, class_names(spec.dataset, num_classes)

    def write(arts: DeviceArtifacts) -> None:
        if arts.final:  # a simulation keeps what each device ends with, not its state before training
            arts.write(out, names, data=spec.dataset)

    return write


def join_artifact_args(spec: SimulationSpec) -> list[str]:
    """The `protofl-edge join` arguments that make a simulated device process write its artifacts."""
    return [] if spec.out_dir is None else ["--artifacts", str(spec.out_dir)]


def write_run_artifacts(spec: SimulationSpec, fed_data: Federation, agg: Aggregator) -> None:
    """The federation's artifacts from the aggregator's final model."""
    assert spec.out_dir is not None
    cfg = fed_data.cfg
    write_server_artifacts(
        agg.model,
        spec.out_dir,
        fed=FED,
        round_=len(agg.records),
        finished=agg.finished,
        class_names=class_names(spec.dataset, cfg.num_classes),
        written_by="protofl-server simulate",
        data=spec.dataset,
        norm=(fed_data.train.mean, fed_data.train.std),
        backbone=agg.machine.public,
    )
