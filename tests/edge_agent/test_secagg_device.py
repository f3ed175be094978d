"""A device's side of secure aggregation (edge_agent/core/secagg_device.py): the table vector it masks, by hand, and
the answers it keeps (the same server message again gets the same bytes, never a second draw)."""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent.core.sealing import Outgoing
from edge_agent.core.secagg_device import DeviceSecAgg, Masking, table_vector
from protofl import secagg
from protofl.plan import RoundPlan
from protofl.presets import make_config
from protofl.wire import ProtoSet, ProtoUpload, SaKeys, SaRoster, SaShares, SaSurvivors, decode_message, encode_message


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
    kb, kc = b.keys(), DeviceSecAgg("c", "fed", 1, "train", ps).keys()
    roster = SaRoster({"b": (kb.c, kb.s), "c": (kc.c, kc.s)}, t=2, frac_bits=10, bound=100.0, weighted=True)
    first = a.answer(roster, 1, 2)
    assert first is not None and a.answer(roster, 1, 2) is first  # asked again (a server restart): the same answer
    with pytest.raises(secagg.SecAggError, match="before this device sent its masked input"):
        a.answer(SaSurvivors([0]), 1, 2)
    ka = a.keys()
    with pytest.raises(secagg.SecAggError, match="among its own neighbours"):
        b.answer(SaRoster({"b": (ka.c, ka.s), "c": (kc.c, kc.s)}, t=2, frac_bits=10, bound=100.0, weighted=True), 1, 2)


def test_a_device_refuses_a_minority_threshold_or_a_roster_under_the_floor() -> None:
    """The threshold is the device's to judge (issue 58): t must be a strict majority of its k neighbours (2t > k)
    and k at least secagg.MIN_NEIGHBOURS = 2. By hand: k = 4 takes t = 3 or 4 (2 * 3 = 6 > 4), not t = 2 (4 = 4)
    nor t = 1; k = 1 is under the floor whatever t; k = 2 takes only t = 2."""
    assert secagg.MIN_NEIGHBOURS == 2
    assert [t for t in range(1, 6) if secagg.roster_problem(4, t) is None] == [3, 4]
    assert [t for t in range(1, 4) if secagg.roster_problem(3, t) is None] == [2, 3]
    assert [t for t in range(1, 4) if secagg.roster_problem(2, t) is None] == [2]
    assert secagg.roster_problem(1, 1) is not None and "floor of 2" in str(secagg.roster_problem(1, 1))
    assert "not a strict majority of its 4 neighbours" in str(secagg.roster_problem(4, 1))
    ps = ProtoSet(np.array([0]), np.ones((1, 2), np.float32), np.array([3]), dt="f4")
    masking = Masking(
        RoundPlan.from_config(make_config("fedproto", num_classes=2, proto_dim=2, adapter_rank=2, secagg=True))
    )
    up = Outgoing(ProtoUpload(ps, None, 3), fed="fed", sender="a", round=1, phase="train")
    assert isinstance(masking.seal(up, np.random.default_rng(0)).msg, SaKeys)
    keys = {c: DeviceSecAgg(c, "fed", 1, "train", ps).keys() for c in "bcde"}
    lie = SaRoster({c: (k.c, k.s) for c, k in keys.items()}, t=1, frac_bits=10, bound=100.0, weighted=True)
    head, roster = decode_message(encode_message(lie, fed="fed", sender="server", round=1, phase="train"))
    assert isinstance(roster, SaRoster)
    got = masking.answer(head, roster)
    assert got is not None and got.reply is None and got.leave and got.drop is not None
    assert "t=1 is not a strict majority of its 4 neighbours" in got.drop.detail, got.drop.detail
    # The same device takes a strict majority of the same neighbours (a fresh phase's run).
    masking.seal(up, np.random.default_rng(0))
    fine = masking.answer(head, SaRoster(roster.keys, t=3, frac_bits=10, bound=100.0, weighted=True))
    assert fine is not None and isinstance(fine.reply, SaShares) and not fine.leave
