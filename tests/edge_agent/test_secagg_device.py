"""A device's side of secure aggregation (edge_agent/core/secagg_device.py): the table vector it masks, by hand, and
the answers it keeps (the same server message again gets the same bytes, never a second draw)."""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent.core.secagg_device import DeviceSecAgg, table_vector
from protofl import secagg
from protofl.wire import ProtoSet, SaRoster, SaSurvivors


def test_the_table_vector_by_hand() -> None:
    ps = ProtoSet(np.array([0, 2]), np.array([[1.0, 2.0], [3.0, 4.0]], np.float32), np.array([5, 7]), dt="f4")
    # Weighted (fedproto): per class [row * n_kc, n_kc]; class 1 absent: zeros. 1*5, 2*5, 5 | 0 0 0 | 3*7, 4*7, 7.
    assert table_vector(ps, 3, 2, weighted=True).tolist() == [5, 10, 5, 0, 0, 0, 21, 28, 7]
    # Otherwise the row and 1 for a class it sends.
    assert table_vector(ps, 3, 2, weighted=False).tolist() == [1, 2, 1, 0, 0, 0, 3, 4, 1]
    # The rows as the server would have read them: f2 keeps 1.1 as 1.099609375 (= 1126 / 1024).
    half = ProtoSet(np.array([1]), np.array([[1.1, 0.5]], np.float32), None, dt="f2")
    assert table_vector(half, 2, 2, weighted=False).tolist() == [0, 0, 0, 1.099609375, 0.5, 1]


def test_a_device_keeps_its_answers_and_refuses_what_does_not_fit() -> None:
    ps = ProtoSet(np.array([0]), np.ones((1, 2), np.float32), np.array([3]), dt="f4")
    a, b = DeviceSecAgg("a", "fed", 1, "train", ps), DeviceSecAgg("b", "fed", 1, "train", ps)
    kb = b.keys()
    roster = SaRoster({"b": (kb.c, kb.s)}, t=1, frac_bits=10, bound=100.0, weighted=True)
    first = a.answer(roster, 1, 2)
    assert first is not None and a.answer(roster, 1, 2) is first  # asked again (a server restart): the same answer
    with pytest.raises(secagg.SecAggError, match="before this device sent its masked input"):
        a.answer(SaSurvivors([0]), 1, 2)
    ka = a.keys()
    with pytest.raises(secagg.SecAggError, match="among its own neighbours"):
        b.answer(SaRoster({"b": (ka.c, ka.s)}, t=1, frac_bits=10, bound=100.0, weighted=True), 1, 2)
