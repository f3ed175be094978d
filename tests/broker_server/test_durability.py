"""Journal, checkpoint and restart of the aggregator, without a broker (fast; the crash test over real
Mosquitto and real processes is test_crash.py).

The in-process federation below is cut after every message it applied: a fresh aggregator restored from
the state dir as it was then, fed everything from the cut on again (the broker redelivers what was not
acknowledged, and devices resend), must end with the uninterrupted run's state, bit for bit: same
uploads, folded in the same (journal) order."""

from __future__ import annotations

import itertools
import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from broker_server.core.durable import DurableState, journal_records
from broker_server.core.journal import HEADER, Journal, JournalError, encode_record
from broker_server.core.shell import Aggregator
from protofl import topics
from protofl.algorithms.robust import ClipPolicy
from protofl.checkpoint import CheckpointError, read_checkpoint, write_checkpoint
from protofl.config import FederationConfig
from protofl.plan import Phase
from protofl.presets import make_config
from protofl.sparse import SparseVector
from protofl.transport import InProcessBroker
from protofl.wire import (
    Config,
    Join,
    ParamsUpload,
    ProtoSet,
    ProtoUpload,
    PublicSet,
    RoundStart,
    Status,
    decode_message,
    encode_message,
)
from tests.broker_server.durable_helpers import start_durable
from tests.pipelines import ADAPTER_PIPELINE
from tests.wire_helpers import decode_as, ridge_upload

FED = "dur"


# -- journal ----------------------------------------------------------------------------------


def _records(path: Path, n: int) -> list[bytes]:
    recs = [encode_record(f"t/{i}", bytes([i]) * (10 + i), f"c{i}", "protos", 1, "train") for i in range(n)]
    path.write_bytes(b"".join(recs))
    return recs


def test_a_torn_last_record_is_dropped_at_every_cut(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "journal.log"
    recs = _records(path, 3)
    whole = b"".join(recs)
    two = len(recs[0]) + len(recs[1])
    for cut in range(two, len(whole)):  # a crash anywhere inside the third record's write
        path.write_bytes(whole[:cut])
        with caplog.at_level(logging.WARNING, logger="protofl.durability"):
            j = Journal(path)
        assert [r.client for r in j.records] == ["c0", "c1"]
        assert path.stat().st_size == two == j.size  # truncated: the next append starts clean
        assert cut == two or "a torn last record" in caplog.text
        # The torn tail is kept aside as evidence, byte for byte.
        assert cut == two or (tmp_path / f"journal.log.torn-{two}").read_bytes() == whole[two:cut]
        j.append("t/x", b"again", "c2", "protos", 1, "train")
        j.close()
        assert [r.client for r in Journal(path).records] == ["c0", "c1", "c2"]
        caplog.clear()


def test_a_damaged_record_in_the_middle_is_refused_not_skipped(tmp_path: Path) -> None:
    path = tmp_path / "journal.log"
    recs = _records(path, 3)
    data = bytearray(b"".join(recs))
    data[len(recs[0]) + 24] ^= 0xFF  # a flipped bit in the second record's body
    path.write_bytes(bytes(data))
    with pytest.raises(JournalError, match="complete record at byte .* fails its CRC32 check.*damage"):
        Journal(path)
    assert path.read_bytes() == bytes(data)  # refused, and left as it was
    data = bytearray(b"".join(recs))
    data[-3] ^= 0x01  # bit rot in the LAST record, which is complete: damage too, not a torn write
    path.write_bytes(bytes(data))
    with pytest.raises(JournalError, match=f"{path}: the complete record at byte {len(recs[0]) + len(recs[1])}"):
        Journal(path)
    assert path.read_bytes() == bytes(data) and not list(tmp_path.glob("*.torn-*"))  # the evidence is intact
    data = bytearray(b"".join(recs))
    data[len(recs[0])] = ord("X")  # a bad magic
    path.write_bytes(bytes(data))
    with pytest.raises(JournalError, match="bad header"):
        Journal(path)


def test_no_header_bit_flip_truncates_an_acknowledged_record(tmp_path: Path) -> None:
    # Issue 43: the header's lengths were trusted before any check, so 12 % of header bit flips made a complete
    # record (and all after it) read as a torn tail and truncated. Every flip of every header bit is now refused
    # (the header's own CRC) or read back whole; the file is never changed.
    path = tmp_path / "journal.log"
    recs = _records(path, 3)
    whole = b"".join(recs)
    starts = [0, len(recs[0]), len(recs[0]) + len(recs[1])]
    outcomes = {"refused": 0, "whole": 0}
    for start in starts:
        for bit in range(HEADER.size * 8):
            data = bytearray(whole)
            data[start + bit // 8] ^= 1 << (bit % 8)
            path.write_bytes(bytes(data))
            try:
                j = Journal(path)
            except JournalError:
                outcomes["refused"] += 1
            else:
                assert [r.client for r in j.records] == ["c0", "c1", "c2"], (start, bit)
                j.close()
                outcomes["whole"] += 1
            assert path.read_bytes() == bytes(data) and not list(tmp_path.glob("*.torn-*")), (start, bit)
    assert outcomes == {"refused": 3 * HEADER.size * 8, "whole": 0}


def test_a_length_flip_in_an_old_header_is_refused_when_a_record_follows(tmp_path: Path) -> None:
    # PFJ2 headers (issue 27 to 43) carry no CRC of their own: a length flip that points past the end of the file
    # is told from a torn write by the whole record after it.
    import struct
    import zlib

    import msgpack

    def v2(i: int) -> bytes:
        meta = msgpack.packb({"t": f"t/{i}", "c": f"c{i}", "k": "protos", "r": 1, "ph": "train"}, use_bin_type=True)
        payload = bytes([i]) * 40
        return struct.pack(">4sIII", b"PFJ2", len(meta), len(payload), zlib.crc32(payload, zlib.crc32(meta))) + (
            meta + payload
        )

    path = tmp_path / "journal.log"
    recs = [v2(i) for i in range(3)]
    for byte, bit in itertools.product((6, 9, 10), range(8)):  # meta and payload lengths made to reach past the end
        data = bytearray(b"".join(recs))
        data[len(recs[0]) + byte] ^= 1 << bit
        path.write_bytes(bytes(data))
        with pytest.raises(JournalError, match=f"byte {len(recs[0])} claims .* past the end .* a whole record"):
            Journal(path)
        assert path.read_bytes() == bytes(data)
    path.write_bytes(b"".join(recs)[:-7])  # the last record cut short is still a torn write
    assert [r.client for r in Journal(path).records] == ["c0", "c1"]


def test_a_journal_cut_below_the_checkpoint_offset_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "journal.log"
    recs = _records(path, 3)
    whole = b"".join(recs)
    cut = whole[: len(whole) - 5]  # the last record torn, but the checkpoint reflects it
    path.write_bytes(cut)
    with pytest.raises(JournalError, match=f"{path}: the checkpoint says the journal holds {len(whole)} bytes"):
        Journal(path, keep=len(whole))
    assert path.read_bytes() == cut and not list(tmp_path.glob("*.torn-*"))  # nothing changed
    assert [r.client for r in Journal(path, keep=len(recs[0])).records] == ["c0", "c1"]  # above it: a torn tail


def test_the_payload_is_journaled_as_it_arrived(tmp_path: Path) -> None:
    payload = encode_message(Join(arch="a", n_samples=3), fed=FED, sender="c1")
    j = Journal(tmp_path / "journal.log")
    j.append("t/c1", payload, "c1", "join", 0, "")
    j.close()
    data = (tmp_path / "journal.log").read_bytes()
    assert data.startswith(b"PFJ3") and data.endswith(payload)  # the bytes themselves, after header and meta
    [rec] = Journal(tmp_path / "journal.log").records
    assert (rec.topic, rec.payload, rec.client, rec.kind, rec.round, rec.phase) == (
        "t/c1",
        payload,
        "c1",
        "join",
        0,
        "",
    )


def test_a_journal_of_the_previous_format_is_still_read(tmp_path: Path) -> None:
    import struct
    import zlib

    import msgpack

    def old_record(i: int) -> bytes:  # PFJ1, as written before issue 27: the payload inside a msgpack body
        body = msgpack.packb(
            {"t": f"t/{i}", "p": bytes([i]) * 5, "c": f"c{i}", "k": "protos", "r": 1, "ph": "train"}, use_bin_type=True
        )
        return struct.pack(">4sII", b"PFJ1", len(body), zlib.crc32(body)) + body

    path = tmp_path / "journal.log"
    path.write_bytes(old_record(0) + old_record(1))
    j = Journal(path)
    j.append("t/2", b"\x02" * 5, "c2", "protos", 1, "train")  # a restarted server goes on in the new format
    j.close()
    recs = Journal(path).records
    assert [(r.client, r.payload) for r in recs] == [(f"c{i}", bytes([i]) * 5) for i in range(3)]
    data = bytearray(path.read_bytes())
    data[20] ^= 0x01  # damage inside an old record is still refused
    path.write_bytes(bytes(data))
    with pytest.raises(JournalError, match="fails its CRC32 check"):
        Journal(path)


# -- checkpoint -------------------------------------------------------------------------------


def test_packb_writes_pack_trees_bytes_without_its_walk() -> None:
    # Issue 48: the shards' messages and checkpoints are packed by msgpack's C walk (numpy leaves called back);
    # the bytes are the Python walk's, so what was written before reads the same and a shard of either agrees.
    import msgpack

    from protofl.checkpoint import pack_tree, packb

    tree = {
        "a": np.arange(6, dtype=np.float32).reshape(2, 3),
        "t": (1, np.float64(0.5), np.float32(0.25), np.int64(-3), np.bool_(True), np.uint8(7)),
        "m": {"k": [np.zeros(0, np.int64), None, "x", 2**40]},
    }
    assert packb(tree) == msgpack.packb(pack_tree(tree), use_bin_type=True)
    with pytest.raises(TypeError, match="set cannot be written"):
        packb({"s": {1}})


def test_checkpoint_round_trip_and_a_corrupt_one_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.bin"
    assert read_checkpoint(path) is None
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    write_checkpoint(path, {"a": a, "n": None, "l": [1, "x", {"k": np.int64(3)}]})
    back = read_checkpoint(path)
    assert back is not None and back["n"] is None and back["l"] == [1, "x", {"k": 3}]
    assert back["a"].dtype == np.float32 and back["a"].tobytes() == a.tobytes()
    assert not path.with_name("checkpoint.bin.tmp").exists()
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"checkpoint {path} is corrupt \(SHA-256 mismatch.*move it aside"):
        read_checkpoint(path)
    path.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="not a protofl checkpoint"):
        read_checkpoint(path)


# -- restart at every moment ------------------------------------------------------------------

CLIENTS = ["c0", "c1", "c2"]


def _cfg(preset: str) -> FederationConfig:
    if preset == "fedpagr+erpa":  # candidate (d): public-set unit prototypes ride on the training upload
        return make_config(
            "fedpagr",
            rounds=3,
            min_clients=3,
            proto_dim=20,
            adapter_rank=2,
            num_classes=3,
            round_timeout=600.0,
            seed=3,
            refine=False,
            erpa=True,
            public_classes=(0, 1),
        )
    if preset == "protofl+adapters":  # APUD adapters and CPS-scaled prototypes in one upload
        return make_config(
            "protofl",
            rounds=3,
            min_clients=3,
            proto_dim=20,
            adapter_rank=2,
            num_classes=3,
            round_timeout=600.0,
            seed=3,
            **ADAPTER_PIPELINE,
        )
    route: dict[str, Any] = {"ridge_topk": 0.001} if preset.endswith("+route") else {}  # the opt-in route
    return make_config(
        preset.removesuffix("+route"),
        rounds=3,
        min_clients=3,
        proto_dim=20,
        adapter_rank=2,
        num_classes=3,
        round_timeout=600.0,
        seed=3,
        **route,
    )


# The ridge predictor's route (protofl/algorithms/ridge.py) needs the shared backbone the public message ships: here
# a whole model vector of 20 values and then the head's 3 x 20 + 3.
ROUTE_G = np.linspace(-1, 1, 20 + 63, dtype=np.float32)


def _public(preset: str) -> PublicSet | None:
    if not preset.endswith("+route"):
        return None
    return PublicSet(x=np.zeros((0, 1, 2, 2), np.uint8), y=np.zeros(0, np.int64), classes=[], backbone=ROUTE_G)


def _messages(preset: str, agg: Aggregator) -> list[tuple[str, bytes]]:
    """Joins, then each client's training uploads for rounds 1-3 (deterministic in client and round)."""
    out = [
        (
            topics.up(FED, c),
            encode_message(Join(arch="", n_samples=10 + k, profile="", agent_version="t"), fed=FED, sender=c),
        )
        for k, c in enumerate(CLIENTS)
    ]
    adapter = agg.model.rules.state_values().get("adapter")
    n_adapter = adapter.shape[0] if adapter is not None else 0
    width = agg.machine.plan.proto_width  # CPS: only the class's support travels
    for r in (1, 2, 3):
        for k, c in enumerate(CLIENTS):
            rng = np.random.default_rng(100 * r + k)
            if agg.machine.plan.public_phase is Phase.TRAIN:
                public = ProtoSet(classes=np.arange(2), values=rng.normal(size=(2, width)).astype(np.float32), dt="f4")
                protos = ProtoSet(classes=np.array([2]), values=rng.normal(size=(1, width)).astype(np.float32), dt="f4")
            else:
                public = None
                protos = ProtoSet(
                    classes=np.arange(3),
                    values=rng.normal(size=(3, width)).astype(np.float32),
                    counts=np.asarray([5 + k, 6, 7]),
                    dt="f4",
                )
            out.append(
                (
                    topics.up(FED, c),
                    encode_message(
                        ProtoUpload(local=protos, public=public, n_samples=18),
                        fed=FED,
                        sender=c,
                        round=r,
                        phase="train",
                    ),
                )
            )
            route = agg.model.rules.state_values().get("g") is not None
            if route and r > 1:  # the route's update of g: K = 1 of its 83 values
                update = SparseVector(ROUTE_G.size, rng.choice(ROUTE_G.size, 1), rng.normal(size=1).astype(np.float32))
                up = ParamsUpload(update=update, n_samples=18, base_round=r)
                out.append((topics.up(FED, c), encode_message(up, fed=FED, sender=c, round=r, phase="train")))
            elif not n_adapter and agg.machine.plan.shared_backbone:  # the ridge predictor's statistics
                up = ridge_upload(agg.machine.cfg, r, 18, rng)
                out.append((topics.up(FED, c), encode_message(up, fed=FED, sender=c, round=r, phase="train")))
            if n_adapter:
                idx = np.sort(rng.choice(n_adapter, size=5, replace=False)).astype(np.int64)
                up = ParamsUpload(
                    update=SparseVector(n_adapter, idx, rng.normal(size=5).astype(np.float32)),
                    n_samples=18,
                    base_round=r,
                )
                out.append((topics.up(FED, c), encode_message(up, fed=FED, sender=c, round=r, phase="train")))
    return out


def _aggregator(
    preset: str,
    state: Path | None,
    broker: InProcessBroker | None = None,
    rotate_bytes: int = 1 << 20,
    cfg: FederationConfig | None = None,
    public: PublicSet | None = None,
    policy: ClipPolicy | None = None,
) -> tuple[Aggregator, DurableState | None]:
    agg = Aggregator(
        cfg or _cfg(preset),
        FED,
        (broker or InProcessBroker()).connect("server"),
        expected_clients=CLIENTS,
        public=public or _public(preset),
        policy=policy,
    )
    return agg, start_durable(agg, state, FED, rotate_bytes=rotate_bytes)


def feed_and_cut(live: Aggregator, msgs: list[tuple[str, bytes]], tmp_path: Path) -> list[Path]:
    """Feed `msgs` to `live` (durable in tmp_path/live), copying its state dir after each: cut0, cut1, ... as a
    crash right after that message would leave it."""
    cuts = []
    for i, (t, p) in enumerate(msgs):
        live.on_message(t, p)
        cuts.append(tmp_path / f"cut{i}")
        shutil.copytree(tmp_path / "live", cuts[-1])
    return cuts


def _state(agg: Aggregator) -> dict[str, bytes]:
    m = agg.model
    values = m.rules.state_values()
    out = {f"proto{c}": v.tobytes() for c, v in values.get("prototypes", {}).items()}
    if values.get("adapter") is not None:
        out["adapter"] = values["adapter"].tobytes()
    if values.get("unit") is not None:
        out["unit"] = values["unit"].tobytes()
    if values.get("g") is not None:  # the ridge predictor's route: g and its version
        out["g"] = values["g"].tobytes() + str(values["g_version"]).encode()
    return out


@pytest.mark.parametrize(
    "preset,rotate",
    [
        ("fedproto", 1 << 20),
        ("protofl+adapters", 1 << 20),
        ("protofl+adapters", 0),
        ("protofl", 1 << 20),
        ("protofl+route", 1 << 20),
        ("fedpagr+erpa", 1 << 20),
    ],
)
def test_a_restart_after_any_message_ends_in_the_same_state(preset: str, rotate: int, tmp_path: Path) -> None:
    # rotate 0: a new journal segment at every phase boundary; 1 MiB: one segment for the whole run.
    ref, _ = _aggregator(preset, None)
    msgs = _messages(preset, ref)
    for t, p in msgs:
        ref.on_message(t, p)
    assert ref.finished and ref.dropped == {} and len(ref.records) == 3
    if preset.endswith("+route"):  # g: round 1's head, then rounds 2 and 3's updates
        assert ref.model.rules.state_values()["g_version"] == 3

    live, durable = _aggregator(preset, tmp_path / "live", rotate_bytes=rotate)
    cuts = feed_and_cut(live, msgs, tmp_path)
    assert durable is not None and live.finished and _state(live) == _state(ref)
    durable.close()
    for i, cut in enumerate(cuts):
        agg, d = _aggregator(preset, cut, rotate_bytes=rotate)
        # The last applied message was perhaps not acknowledged: the broker delivers it again.
        for t, p in msgs[i:]:
            agg.on_message(t, p)
        assert agg.finished and _state(agg) == _state(ref), f"restart after message {i}"
        # ... and is dropped: a duplicate, or stale if it closed its phase (a join again is no upload).
        assert sum(agg.dropped.values()) == (i >= 3) and set(agg.dropped) <= {"duplicate", "stale"}, agg.dropped
        assert [r.round for r in agg.records] == [1, 2, 3]
        # Bytes sent are counted once, restart or not (the round message's before its boundary's checkpoint).
        assert [r.downlink_bytes for r in agg.records] == [r.downlink_bytes for r in ref.records], f"message {i}"
        assert d is not None
        d.close()
        # The journal holds every accepted message exactly once.
        keys = [(r.client, r.kind, r.round) for r in journal_records(cut)]
        assert len(keys) == len(set(keys)) == len(msgs)
    segments = sorted(p.name for p in (tmp_path / "live").glob("journal-*.log"))
    assert segments == [f"journal-{i:06d}.log" for i in range(len(segments))]
    assert len(segments) == (1 if rotate else 1 + 3 + 1)  # 0: the joins, one a round, an empty one after the end


def test_a_corrupt_checkpoint_stops_the_restart_with_the_file_named(tmp_path: Path) -> None:
    agg, durable = _aggregator("fedproto", tmp_path)
    for t, p in _messages("fedproto", agg)[:4]:
        agg.on_message(t, p)
    assert durable is not None
    durable.close()
    ck = tmp_path / "checkpoint.bin"
    data = bytearray(ck.read_bytes())
    data[len(data) // 2] ^= 0x10
    ck.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"checkpoint {ck} is corrupt"):
        _aggregator("fedproto", tmp_path)
    # and a checkpoint of another config is not resumed either
    ck.unlink()
    agg, durable = _aggregator("fedproto", tmp_path)  # journal only: the joins are replayed
    assert durable is not None and sorted(agg.clients) == CLIENTS and agg.round == 1
    durable.close()
    other = Aggregator(
        make_config(
            "fedproto",
            rounds=4,
            min_clients=3,
            proto_dim=20,
            adapter_rank=2,
            num_classes=3,
            round_timeout=600.0,
            seed=3,
        ),
        FED,
        InProcessBroker().connect("s"),
        expected_clients=CLIENTS,
    )
    d = DurableState(tmp_path, FED)
    d.bind(other)
    with pytest.raises(
        CheckpointError,
        match="cannot be resumed: the saved federation was run with another config "
        r"\(differs in: .*rounds",
    ):
        d.restore()


def test_a_restarted_aggregator_announces_the_same_round_with_the_full_adapter(tmp_path: Path) -> None:
    # The retained round message is how devices resume, and how a device that missed rounds catches up:
    # it carries the whole global adapter (dense), never a delta. After a crash mid-round 3, the restarted
    # aggregator publishes the same config and the same round message again (all but the deadline).
    live_broker = InProcessBroker()
    agg, durable = _aggregator("protofl+adapters", tmp_path / "live", live_broker)
    msgs = _messages("protofl+adapters", agg)
    for t, p in msgs[: 3 + 2 * 6 + 2]:  # joins, rounds 1 and 2, and one upload pair of round 3
        agg.on_message(t, p)
    assert agg.round == 3 and durable is not None
    before = dict(live_broker.retained)
    shutil.copytree(tmp_path / "live", tmp_path / "crash")
    durable.close()
    broker = InProcessBroker()
    again, d = _aggregator("protofl+adapters", tmp_path / "crash", broker)
    assert again.round == 3 and d is not None and d.replayed == 2
    env0, msg0 = decode_message(before[topics.round_(FED)])
    env1, msg1 = decode_message(broker.retained[topics.round_(FED)])
    assert (env0.round, env0.phase) == (env1.round, env1.phase) == (3, "train")
    assert isinstance(msg0, RoundStart) and isinstance(msg1, RoundStart)
    adapter = again.model.rules.state_values()["adapter"]
    assert msg1.adapter is not None and msg0.adapter is not None and adapter is not None
    assert msg1.adapter.shape == adapter.shape  # dense: the full adapter
    assert msg1.adapter.tobytes() == msg0.adapter.tobytes() == adapter.tobytes()
    cfg0, cfg1 = (decode_as(Config, b[topics.config(FED)]) for b in (before, broker.retained))
    assert (cfg1.params, cfg1.adapter_layout) == (cfg0.params, cfg0.adapter_layout)
    _, status = decode_message(broker.retained[topics.server_status(FED)])
    assert isinstance(status, Status) and status.state == "running"  # not "waiting": devices keep their rounds
    d.close()


def test_start_refuses_a_corrupt_checkpoint_and_changes_nothing(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from broker_server.cli import app

    agg_dir = tmp_path / "aggregator"
    agg_dir.mkdir()
    ck = agg_dir / "checkpoint.bin"
    ck.write_bytes(b"PFCK1\n" + b"\0" * 32 + b"not the body that was hashed")
    r = CliRunner().invoke(
        app,
        [
            "start",
            "--broker",
            "mqtt://127.0.0.1:9",
            "--preset",
            "fedproto",
            "--state-dir",
            str(tmp_path),
            "--connect-timeout",
            "1",
        ],
    )
    assert r.exit_code == 2
    assert f"error: checkpoint {ck} is corrupt (SHA-256 mismatch" in r.output and "move it aside" in r.output
    assert sorted(p.name for p in agg_dir.iterdir()) == ["checkpoint.bin"]  # no journal started beside it


def test_an_erpa_federation_restarts_in_its_prototype_phase_too(tmp_path: Path) -> None:
    # refprotofl: a prototype phase (public-set and local prototypes -> anchors), then a training phase
    # (APUD adapters). A restart after any message, either phase, ends bit-identical.
    cfg = make_config(
        "refprotofl",
        rounds=2,
        min_clients=3,
        proto_dim=20,
        adapter_rank=2,
        num_classes=3,
        round_timeout=600.0,
        seed=3,
        public_classes=(0, 1),
        public_per_class=2,
    )
    public = PublicSet(x=np.zeros((4, 1, 4, 4), np.uint8), y=np.asarray([0, 0, 1, 1]), classes=[0, 1])

    def make(state: Path | None) -> tuple[Aggregator, DurableState | None]:
        return _aggregator("refprotofl", state, rotate_bytes=0, cfg=cfg, public=public)

    ref, _ = make(None)
    plan, n_adapter = ref.machine.plan, ref.model.rules.state_values()["adapter"].shape[0]
    msgs = [
        (
            topics.up(FED, c),
            encode_message(Join(arch="", n_samples=9, profile="", agent_version="t"), fed=FED, sender=c),
        )
        for c in CLIENTS
    ]
    for r in (1, 2):
        for k, c in enumerate(CLIENTS):
            rng = np.random.default_rng(10 * r + k)
            pub = ProtoSet(
                classes=np.asarray([0, 1]),
                values=rng.normal(size=(2, plan.proto_width)).astype(np.float32),
                counts=np.asarray([2, 2]),
                dt="f4",
            )
            loc = ProtoSet(
                classes=np.asarray([2]),
                values=rng.normal(size=(1, plan.proto_width)).astype(np.float32),
                counts=np.asarray([5 + k]),
                dt="f4",
            )
            msgs.append(
                (
                    topics.up(FED, c),
                    encode_message(
                        ProtoUpload(local=loc, public=pub, n_samples=9), fed=FED, sender=c, round=r, phase="proto"
                    ),
                )
            )
        for k, c in enumerate(CLIENTS):
            rng = np.random.default_rng(100 * r + k)
            idx = np.sort(rng.choice(n_adapter, size=5, replace=False)).astype(np.int64)
            up = ParamsUpload(
                update=SparseVector(n_adapter, idx, rng.normal(size=5).astype(np.float32)), n_samples=9, base_round=r
            )
            msgs.append((topics.up(FED, c), encode_message(up, fed=FED, sender=c, round=r, phase="train")))
    for t, p in msgs:
        ref.on_message(t, p)
    assert ref.finished and ref.dropped == {}, ref.dropped
    live, durable = make(tmp_path / "live")
    cuts = []
    for i, (t, p) in enumerate(msgs):
        live.on_message(t, p)
        shutil.copytree(tmp_path / "live", tmp_path / f"cut{i}")
        cuts.append(tmp_path / f"cut{i}")
    assert durable is not None
    durable.close()
    for i, cut in enumerate(cuts):
        agg, d = make(cut)
        for t, p in msgs[i:]:
            agg.on_message(t, p)
        assert (
            agg.finished
            and agg.model.rules.state_values()["adapter"].tobytes()
            == ref.model.rules.state_values()["adapter"].tobytes()
        ), i
        got, want = (a.model.rules.state_values()["targets"] for a in (agg, ref))
        assert got is not None and want is not None
        assert got.values.tobytes() == want.values.tobytes(), i
        assert d is not None
        d.close()


# -- a state dir of the format before the rules kept their own state ---------------------------------

FORMAT2 = Path(__file__).parent / "state_dirs_format2"


@pytest.mark.parametrize("preset", ["fedproto", "protofl+adapters", "fedpagr+erpa"])
def test_a_state_dir_of_format_2_resumes_and_ends_in_the_same_state(preset: str, tmp_path: Path) -> None:
    # Written by main ff023dc (durable.py format 2: the technique values inside the server model's checkpoint):
    # round 2 open, one device's round-2 uploads journaled after its checkpoint (state_dirs_format2/README.md).
    state = tmp_path / "state"
    shutil.copytree(FORMAT2 / preset.replace("+", "-"), state)
    saved = read_checkpoint(state / "checkpoint.bin")
    assert saved is not None and saved["format"] == 2
    ref, _ = _aggregator(preset, None)
    msgs = _messages(preset, ref)
    for t, p in msgs:
        ref.on_message(t, p)
    applied = len(journal_records(state))
    agg, d = _aggregator(preset, state)
    assert agg.round == 2 and d is not None
    for t, p in msgs[applied - 1 :]:  # the last one journaled comes again: a duplicate
        agg.on_message(t, p)
    assert agg.finished and _state(agg) == _state(ref) and agg.dropped == {"duplicate": 1}
    assert [r.clipped for r in agg.records] == [r.clipped for r in ref.records]
    d.close()
    saved = read_checkpoint(state / "checkpoint.bin")
    assert saved is not None and saved["format"] == 3  # written anew at the boundaries since


def test_a_checkpoint_without_a_techniques_state_is_refused_with_what_is_missing(tmp_path: Path) -> None:
    state = tmp_path / "state"
    shutil.copytree(FORMAT2 / "fedproto", state)
    saved = read_checkpoint(state / "checkpoint.bin")
    assert saved is not None
    del saved["machine"]["model"]["prototypes"]  # neither the format-2 place nor the per-technique one
    write_checkpoint(state / "checkpoint.bin", saved)
    with pytest.raises(CheckpointError, match="the state of technique 'fedproto' has no saved 'prototypes'"):
        _aggregator("fedproto", state)
