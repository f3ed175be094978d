"""Secure aggregation (protofl/secagg.py), pure: the unmasked sum is the plain sum within the fixed point's
tolerance with 0, 1 and a quorum's worth of devices dropped; what the server holds before unmasking tells it
nothing of one device; the graph is sparse; too few shares or a double ask is refused."""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgpack
import numpy as np
import pytest

from protofl import secagg
from protofl.secagg import Device, FixedPoint, SecAggError, Server

CTX = secagg.context("lab", 3, "train")


def run_phase(
    inputs: dict[str, np.ndarray],
    ring: FixedPoint,
    *,
    drop_before_shares: Sequence[str] = (),
    drop_before_input: Sequence[str] = (),
    silent_at_unmask: Sequence[str] = (),
    k: int | None = None,
) -> tuple[np.ndarray, Server, dict[str, Device]]:
    """One phase through every step, devices dropping where told; returns (the decoded sum, server, devices)."""
    server = Server(CTX, seed=b"phase-seed", k=k)
    devices = {i: Device(i, CTX) for i in inputs}
    for i, d in devices.items():
        server.advertised(i, d.advertise())
    keys_for = server.close_advertise()
    t = server.threshold()
    sent = {i: devices[i].share_keys(keys_for[i], t) for i in devices if i not in drop_before_shares}
    for v, boxes in server.route_shares(sent).items():
        devices[v].receive_shares(boxes)
    for i in sorted(server.shared):
        if i not in drop_before_input:
            server.received(i, devices[i].masked_input(ring.encode(inputs[i]), server.shared))
    survivors = set(server.masked)
    answers = {i: devices[i].unmask(survivors) for i in sorted(survivors) if i not in silent_at_unmask}
    return ring.decode(server.unmask(answers)), server, devices


def test_fixed_point_by_hand() -> None:
    ring = FixedPoint.for_sum(bound=1.0, devices=4)
    # 4 * 1.0 * 2^f < 2^31 - 1: f = floor(log2(536870911.75)) = 28
    assert ring.frac_bits == 28 and ring.resolution == 2.0**-28
    enc = ring.encode(np.array([0.5, -0.25, 1.0]))
    assert enc.tolist() == [2**27, 2**32 - 2**26, 2**28]  # -0.25 wraps to 2^32 - 2^26
    assert ring.decode(enc + enc).tolist() == [1.0, -0.5, 2.0]
    with pytest.raises(ValueError, match="within"):
        ring.encode(np.array([1.5]))


def test_masks_of_a_pair_cancel_by_hand() -> None:
    a, b = Device("a", CTX), Device("b", CTX)
    ka, kb = a.advertise(), b.advertise()
    key_ab = secagg.pair_key(a._s, kb.s, CTX)
    assert key_ab == secagg.pair_key(b._s, ka.s, CTX)  # X25519 agreement: the same key on both sides
    m_ab, m_ba = secagg.pair_mask("a", "b", key_ab, 5), secagg.pair_mask("b", "a", key_ab, 5)
    assert (m_ab + m_ba).tolist() == [0] * 5  # +PRG for the smaller id, -PRG for the larger, mod 2^32
    assert secagg.prg(key_ab, 5).tolist() == secagg.prg(key_ab, 5).tolist()  # AES-CTR: the same everywhere


def test_shamir_by_hand() -> None:
    secret = bytes(range(32))
    shares = secagg.split(secret, [1, 2, 3, 4, 5], t=3)
    assert secagg.combine({x: shares[x] for x in (2, 4, 5)}, 3) == secret
    assert secagg.combine({x: shares[x] for x in (1, 3, 5)}, 3) == secret
    with pytest.raises(SecAggError, match="2 shares, 3 needed"):
        secagg.combine({1: shares[1], 2: shares[2]}, 3)


# Five devices, each a 4-value vector: the plain sum by hand is [1.0, -1.25, 0.5, 2.0].
FIVE = {
    "d1": np.array([0.5, -0.5, 0.0, 1.0]),
    "d2": np.array([0.25, -0.25, 0.5, 0.25]),
    "d3": np.array([0.0, 0.0, -0.5, 0.25]),
    "d4": np.array([0.25, -0.25, 0.25, 0.25]),
    "d5": np.array([0.0, -0.25, 0.25, 0.25]),
}


def test_nothing_dropped_unmasks_the_plain_sum() -> None:
    ring = FixedPoint.for_sum(1.0, 5)
    total, server, _ = run_phase(FIVE, ring)
    assert np.allclose(total, [1.0, -1.25, 0.5, 2.0], atol=5 * ring.resolution)
    # What the server held before unmasking: each masked input looks nothing like its input.
    for i, y in server.masked.items():
        assert not np.allclose(ring.decode(y), FIVE[i], atol=0.5)


def test_one_dropped_after_sharing_its_keys_unmasks_the_survivors_sum() -> None:
    ring = FixedPoint.for_sum(1.0, 5)
    total, server, _ = run_phase(FIVE, ring, drop_before_input=["d2"])
    # without d2: [1.0 - 0.25, -1.25 + 0.25, 0.5 - 0.5, 2.0 - 0.25]
    assert set(server.masked) == {"d1", "d3", "d4", "d5"}
    assert np.allclose(total, [0.75, -1.0, 0.0, 1.75], atol=5 * ring.resolution)


def test_a_quorums_worth_dropped_at_every_step_still_unmasks() -> None:
    # 40 devices, sparse graph (k = 12 of 39), quorum 30: 4 drop before sharing keys, 6 after (before their masked
    # input), and 2 survivors say nothing at unmasking.
    rng = np.random.default_rng(3)
    inputs = {f"dev{i:02d}": rng.uniform(-1, 1, 51) for i in range(40)}
    ring = FixedPoint.for_sum(1.0, 40)
    early, late, silent = (
        ["dev00", "dev07", "dev13", "dev21"],
        ["dev02", "dev09", "dev15", "dev22", "dev30", "dev33"],
        [
            "dev05",
            "dev38",
        ],
    )
    total, server, _ = run_phase(
        inputs, ring, drop_before_shares=early, drop_before_input=late, silent_at_unmask=silent
    )
    kept = sorted(set(inputs) - set(early) - set(late))
    assert len(kept) == 30 and sorted(server.masked) == kept
    plain = np.sum([inputs[i] for i in kept], axis=0)
    assert np.abs(total - plain).max() <= 30 * ring.resolution
    assert max(len(v) for v in server.graph.values()) == secagg.degree(40) == 12


def test_too_few_neighbours_answering_cannot_unmask() -> None:
    ring = FixedPoint.for_sum(1.0, 5)
    with pytest.raises(SecAggError, match="needed"):
        run_phase(FIVE, ring, silent_at_unmask=["d1", "d2", "d3"])  # 2 of 4 neighbours answer; t = 3


def test_a_device_refuses_to_give_both_secrets_of_one_neighbour() -> None:
    ring = FixedPoint.for_sum(1.0, 5)
    _, server, devices = run_phase(FIVE, ring)
    d = devices["d1"]
    with pytest.raises(SecAggError, match="both secrets of d2"):
        d.unmask(set(FIVE) - {"d2"})  # it gave d2's self-mask share already; now asked for its mask key


def test_the_graph_is_symmetric_and_grows_with_log_n() -> None:
    for n in (10, 100, 1000):
        ids = [f"d{i}" for i in range(n)]
        g = secagg.neighbours(ids, b"s")
        assert all(u in g[v] for u in g for v in g[u])
        k = secagg.degree(n)
        assert k == min(n - 1, 2 * math.ceil(math.log2(n)))
        assert {len(v) for v in g.values()} == {k}


def test_a_server_restarted_mid_unmask_resumes_from_its_saved_state() -> None:
    ring = FixedPoint.for_sum(1.0, 5)
    server = Server(CTX, seed=b"phase-seed")
    devices = {i: Device(i, CTX) for i in FIVE}
    for i, d in devices.items():
        server.advertised(i, d.advertise())
    keys_for = server.close_advertise()
    sent = {i: devices[i].share_keys(keys_for[i], server.threshold()) for i in devices}
    for v, boxes in server.route_shares(sent).items():
        devices[v].receive_shares(boxes)
    for i in ("d1", "d3", "d4", "d5"):  # d2 drops after sharing its keys
        server.received(i, devices[i].masked_input(ring.encode(FIVE[i]), server.shared))
    survivors = set(server.masked)
    server.answered("d1", devices["d1"].unmask(survivors))
    server.answered("d3", devices["d3"].unmask(survivors))
    # kill -9 here: what a journal would hold, through msgpack (no pickle), and a new server from it
    saved = msgpack.unpackb(msgpack.packb(server.state(), use_bin_type=True), raw=False, strict_map_key=False)
    again = Server.restore(saved)
    assert again.graph == server.graph and again.masked.keys() == server.masked.keys()
    again.answered("d4", devices["d4"].unmask(survivors))
    again.answered("d5", devices["d5"].unmask(survivors))  # (each survivor needs t = 3 of its 4 neighbours)
    total = ring.decode(again.unmask())
    assert np.allclose(total, [0.75, -1.0, 0.0, 1.75], atol=5 * ring.resolution)  # without d2, as by hand above


def test_prototype_tables_sum_per_class_with_their_senders() -> None:
    # 3 devices, 3 classes, width 2: a class a device lacks travels as zeros with presence 0
    tables = {
        "a": {0: np.array([0.5, 0.5]), 2: np.array([-0.25, 0.0])},
        "b": {0: np.array([0.25, -0.5])},
        "c": {1: np.array([1.0, 0.0]), 2: np.array([0.5, 0.5])},
    }
    vectors = {i: secagg.table_vector(t, 3, 2) for i, t in tables.items()}
    assert vectors["b"].tolist() == [0.25, -0.5, 1.0, 0, 0, 0, 0, 0, 0]
    ring = FixedPoint.for_sum(1.0, 3)
    total, _, _ = run_phase(vectors, ring)
    sums, senders = secagg.table_of_sum(total, 3, 2)
    assert senders == {0: 2, 1: 1, 2: 2}
    assert np.allclose(sums[0], [0.75, 0.0]) and np.allclose(sums[1], [1.0, 0.0]) and np.allclose(sums[2], [0.25, 0.5])


def test_shares_and_boxes_travel_at_their_minimum_width_with_derived_nonces() -> None:
    # Shares are elements of GF(2^256 - 189): 32 bytes; the secrets are drawn below the prime, so they rebuild.
    assert secagg.PRIME == 2**256 - 189 and secagg.SHARE_BYTES == 32 and secagg.BOX_BYTES == 80
    assert all(int.from_bytes(secagg.secret(), "big") < secagg.PRIME for _ in range(50))
    top = (secagg.PRIME - 1).to_bytes(32, "big")  # the largest secret the field holds
    assert secagg.combine(dict(list(secagg.split(top, [1, 2, 3], 2).items())[1:]), 2) == top
    a, b = Device("a", CTX), Device("b", CTX)
    ka, kb = a.advertise(), b.advertise()
    boxes = a.share_keys({"b": kb}, 1)
    assert [len(x) for x in boxes.values()] == [secagg.BOX_BYTES]  # two 32-byte shares and the 16-byte tag
    b.share_keys({"a": ka}, 1)
    b.receive_shares({"a": boxes["b"]})  # (u -> the box u sent)
    assert set(b.held) == {"a"}
    # the nonce of each direction differs, and so does each phase's (the box key is the phase's in any case)
    other = Device("a", secagg.context("lab", 4, "train"))
    assert len({a._nonce("a", "b"), a._nonce("b", "a"), other._nonce("a", "b")}) == 3
    # a box read under the other direction's nonce does not open: the nonce is bound to who sent it to whom
    with pytest.raises(SecAggError, match="does not decrypt"):
        a.receive_shares({"b": boxes["b"]})
