"""bench.bench_aggregator measures every workload it offers: each one's in-process round closes with every device
counted (issue 55: the `protofl` workload's round never closed once the ridge predictor joined the preset, its
synthetic uploads lacking the statistics its devices send), at a tiny size."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from bench.bench_aggregator import (
    WORKLOADS,
    device_bodies,
    inprocess_rate,
    make_uploads,
    read_bodies,
    workload_config,
    write_bodies,
)
from protofl.algorithms.ridge import ridge_length
from protofl.wire import ParamsUpload, ProtoUpload, decode_message


@pytest.mark.parametrize("workload", WORKLOADS)
def test_each_workload_closes_its_round(workload: str) -> None:
    res = inprocess_rate(workload, n=3, distinct=2)  # Setup.drive asserts the round closed with all 3 devices
    assert res["uploads"] == 3 and res["upload_bytes"] > 0 and res["uploads_per_s"] > 0, res


def test_the_default_preset_uploads_its_ridge_statistics_beside_its_prototypes() -> None:
    """Round 1 of the `protofl` preset, as its devices send it: the statistics vector (once, dense float32), then
    the CPS prototypes."""
    _, uploads = make_uploads(workload_config("protofl", 2), 2, 1)
    bodies = [decode_message(p)[1] for p in uploads[0]]
    assert [type(b) for b in bodies] == [ParamsUpload, ProtoUpload], bodies
    stats = bodies[0]
    assert isinstance(stats, ParamsUpload) and isinstance(stats.update, np.ndarray) and stats.dt == "f4"
    assert stats.update.shape == (ridge_length(512, 10),)


def test_bodies_reach_a_publisher_child_as_built(tmp_path: Path) -> None:
    """Through the broker, one file carries the devices' uploads to each publisher child (which builds none)."""
    bodies = device_bodies(workload_config("tinyproto", 2), 2)
    write_bodies(tmp_path / "bodies.bin", bodies)
    _, sent = make_uploads(None, 3, 0, bodies=read_bodies(tmp_path / "bodies.bin"))
    _, built = make_uploads(None, 3, 0, bodies=bodies)

    def unnamed(uploads: list[list[bytes]]) -> list[list[bytes]]:  # each encoding draws its own message id
        return [[re.sub(rb"msg_id\xb0.{16}", b"", p, flags=re.S) for p in mine] for mine in uploads]

    assert unnamed(sent) == unnamed(built) and len(sent[2]) == 1
