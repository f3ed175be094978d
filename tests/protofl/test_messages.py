"""Every message kind round-trips through real bytes; sizes match what the payload arithmetic says."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from protofl.errors import WireError
from protofl.sparse import SparseVector
from protofl.traits import Traits
from protofl.wire import (
    KINDS,
    MESSAGE_TYPES,
    Config,
    Join,
    Message,
    Metrics,
    Pace,
    ParamsUpload,
    ProtoSet,
    ProtoUpload,
    PublicSet,
    Resend,
    RoundStart,
    SaKeys,
    SaMasked,
    SaRoster,
    SaRouted,
    SaShares,
    SaSurvivors,
    SaUnmask,
    Status,
    decode_message,
    encode_message,
    message_size,
)
from tests.wire_helpers import decode_as

RNG = np.random.default_rng(7)


def protos(k: int = 10, w: int = 512, counts: bool = True, dt: str = "f4") -> ProtoSet:
    classes = np.sort(RNG.choice(100, size=k, replace=False))
    values = RNG.standard_normal((k, w)).astype(np.float32)
    return ProtoSet(classes, values, RNG.integers(1, 500, size=k) if counts else None, dt)


def examples() -> list:
    """One or more instances of every kind, covering optional fields both ways."""
    return [
        Join("cnn", 1200, profile="rpi4", agent_version="0.1.0", token="t0k"),
        Join("resnet18", 0),
        Config(
            "tinyproto",
            {"lr": 0.01, "rounds": 50, "stages": ["cps", "scaling"], "mu": "auto", "nested": {"a": [1, None, True]}},
            [("adapter.down", (32, 512)), ("adapter.up", (512, 32)), ("head.weight", (10, 512)), ("head.bias", (10,))],
            RNG.random((10, 512)) < 0.1,
            {"max_upload_bytes": 65536},
        ),
        Config("fedproto"),
        Config("x", class_masks=np.zeros((3, 5), bool)),  # 15 bits: exercises the partial last byte
        PublicSet(RNG.integers(0, 256, (20, 1, 28, 28), dtype=np.uint8), np.repeat(np.arange(10), 2), list(range(10))),
        PublicSet(RNG.random((4, 3, 8, 8), dtype=np.float32), np.array([2, 2, 7, 7]), [2, 7]),
        RoundStart(
            1.7e9,
            adapter=RNG.standard_normal(1000).astype(np.float32),
            targets=protos(10, 51, counts=False),
            target_label="cps",
            participants=["rpi-01", "jetson.02"],
        ),
        RoundStart(12.5, params=RNG.standard_normal(300).astype(np.float32), final=True),
        RoundStart(0.0),
        ProtoUpload(local=protos(3, 51), public=protos(10, 512, counts=False), n_samples=640),
        ProtoUpload(local=None, public=None, n_samples=0),
        ProtoUpload(local=ProtoSet(np.zeros(0, np.int64), np.zeros((0, 51), np.float32)), public=None, n_samples=5),
        ParamsUpload(SparseVector(38_000, np.arange(0, 38_000, 10), np.ones(3800, np.float32)), 640, 4),
        ParamsUpload(SparseVector(100_000, np.array([5, 70_000]), np.array([1.5, -2.0], np.float32)), 64, 0),
        ParamsUpload(RNG.standard_normal(500).astype(np.float32), 10, 3),
        Metrics(100, 87, 1000, 800, RNG.random((1000, 10)).astype(np.float32), 12.5, 0.31, {"norm": 3.5}),
        Metrics(0, 0, 0, 0),
        Metrics(100, 87, 1000, 800, proto_correct_local=90, proto_correct_test=777),
        Status("online", "round 3 train"),
        Status("offline"),
        Resend("join"),
        Resend("uploads"),
        Join("cnn", 10, profile="rpi4+lte", traits=Traits("lte", ("field-a",), "battery", 55)),
        Status("online", "rpi3", Traits(power="mains")),
        Pace(1767225600.0, "not selected"),
        SaKeys(bytes(range(32)), bytes(range(32, 64))),
        SaRoster({"rpi-07": (b"c" * 32, b"s" * 32), "rpi-08": (b"d" * 32, b"t" * 32)}, 2, 16, 100.0, True),
        SaShares([b"x" * 80, b"w" * 80]),
        SaRouted([1], [b"y" * 80]),
        SaMasked(np.arange(6, dtype=np.uint32) * 700_000_000),
        SaSurvivors([0, 8, 1023]),
        SaUnmask([b"y" * 32, b"z" * 32]),
    ]


def test_registry_covers_every_kind() -> None:
    assert set(MESSAGE_TYPES) == KINDS
    assert {type(m) for m in examples()} == set(MESSAGE_TYPES.values())


@pytest.mark.parametrize("msg", examples(), ids=lambda m: type(m).__name__)
def test_roundtrip(msg: Message) -> None:
    envelope: dict[str, Any] = dict(fed="fed-1", sender="rpi-07", round=3, phase="train", msg_id="abc")
    data = encode_message(msg, **envelope)
    env, out = decode_message(data)
    assert (env.v, env.kind, env.fed, env.sender, env.round, env.phase, env.msg_id) == (
        1, msg.KIND, "fed-1", "rpi-07", 3, "train", "abc",
    )  # fmt: skip
    if isinstance(msg, Metrics) and msg.probs is not None:
        # probs always travel as f2.
        assert isinstance(out, Metrics) and out.probs is not None
        assert np.array_equal(out.probs, msg.probs.astype(np.float16).astype(np.float32))
        msg = Metrics(**{**msg.__dict__, "probs": out.probs})
    assert out == msg
    assert message_size(msg, **envelope) == len(data)


def test_decoded_field_types() -> None:
    m = decode_as(ProtoUpload, encode_message(examples()[10], fed="f", sender="s"))
    assert m.local is not None and m.public is not None and m.local.counts is not None
    assert m.local.classes.dtype == np.int64 and m.local.values.dtype == np.float32
    assert m.local.counts.dtype == np.int64 and m.public.counts is None
    a = decode_as(ParamsUpload, encode_message(examples()[13], fed="f", sender="s"))
    assert isinstance(a.update, SparseVector)
    assert a.update.indices.dtype == np.int64 and a.update.values.dtype == np.float32
    c = decode_as(Config, encode_message(examples()[2], fed="f", sender="s"))
    assert c.class_masks is not None
    assert c.class_masks.dtype == np.bool_ and c.adapter_layout[0] == ("adapter.down", (32, 512))


@pytest.mark.parametrize("dt,atol", [("f2", 2e-3), ("q8", 0.03)])
def test_lossy_dtypes(dt: str, atol: float) -> None:
    ps = ProtoSet(np.arange(4), RNG.uniform(-1, 1, (4, 51)).astype(np.float32), dt=dt)
    pu = decode_as(ProtoUpload, encode_message(ProtoUpload(ps, None, 4), fed="f", sender="s"))
    assert pu.local is not None
    assert pu.local.dt == dt and np.allclose(pu.local.values, ps.values, atol=atol)
    adapter, params = RNG.uniform(-1, 1, 200).astype(np.float32), np.ones(3, np.float32)
    rs = decode_as(
        RoundStart, encode_message(RoundStart(1.0, adapter=adapter, params=params, dt=dt), fed="f", sender="s")
    )
    assert rs.adapter is not None and rs.params is not None
    assert rs.dt == dt and np.allclose(rs.adapter, adapter, atol=atol) and np.array_equal(rs.params, params)
    sent = SparseVector(100, np.array([1, 50]), np.array([0.25, -0.5], np.float32))
    up = decode_as(ParamsUpload, encode_message(ParamsUpload(sent, 1, 0, dt=dt), fed="f", sender="s"))
    assert isinstance(up.update, SparseVector)
    assert up.dt == dt and np.allclose(up.update.values, sent.values, atol=atol)


def test_sizes_match_payload_arithmetic() -> None:
    # FedProto: 10 classes x 512 float32 = 20,480 payload bytes, plus class ids and a small envelope.
    full = ProtoUpload(protos(10, 512, counts=True), None, 640)
    assert 20_480 < message_size(full) < 20_480 + 300
    # TinyProto CPS: 10 classes x 51 masked values = 2,040 bytes.
    cps = ProtoUpload(protos(10, 51, counts=False), None, 640)
    assert 2_040 < message_size(cps) < 2_040 + 250
    # f2 halves the payload, q8 quarters it.
    assert 1_020 < message_size(ProtoUpload(protos(10, 51, False, "f2"), None, 1)) < 1_020 + 250
    assert 510 < message_size(ProtoUpload(protos(10, 51, False, "q8"), None, 1)) < 510 + 250
    # APUD at 10% of a 38,000-parameter adapter: 3,800 f4 values + a 4,750-byte mask (u2 indices: 7,600).
    up = ParamsUpload(SparseVector(38_000, np.arange(0, 38_000, 10), np.ones(3800, np.float32)), 640, 4)
    assert 3_800 * 4 + 4_750 < message_size(up) < 3_800 * 4 + 4_750 + 200
    # At 2% the indices win: 760 values + 760 u2 indices = 4,560 bytes.
    up = ParamsUpload(SparseVector(38_000, np.arange(0, 38_000, 50), np.ones(760, np.float32)), 640, 4)
    assert 760 * 6 < message_size(up) < 760 * 6 + 200
    # Class masks: 10 x 512 bits = 640 bytes.
    assert 640 < message_size(Config("x", class_masks=np.ones((10, 512), bool))) < 640 + 200


def test_default_msg_id_is_16_hex() -> None:
    env1, _ = decode_message(encode_message(Status("ok"), fed="f", sender="s"))
    env2, _ = decode_message(encode_message(Status("ok"), fed="f", sender="s"))
    assert len(env1.msg_id) == 16 and int(env1.msg_id, 16) >= 0 and env1.msg_id != env2.msg_id


def test_errors_name_sender_and_round() -> None:
    data = encode_message(Status("ok"), fed="f", sender="rpi-07", round=3)
    import msgpack

    top = msgpack.unpackb(data)
    top["body"]["state"] = 5
    with pytest.raises(WireError, match=r"status: state: expected a string, got int \(sender rpi-07, round 3\)"):
        decode_message(msgpack.packb(top))


@pytest.mark.parametrize(
    "make,reason",
    [
        (lambda: Join("cnn", -1), "n_samples: -1 is outside"),
        (lambda: Join("cnn", True), "expected an integer, got bool"),
        (lambda: Join("cnn", 3.0), "expected an integer, got float"),  # type: ignore[arg-type]  # on purpose
        (lambda: ProtoSet(np.array([2, 1]), np.zeros((2, 4))), "sorted ascending"),
        (lambda: ProtoSet(np.array([70_000]), np.zeros((1, 4))), r"\[0, 65535\]"),
        (lambda: ProtoSet(np.array([1, 2]), np.zeros((3, 4))), "2 classes but 3 prototype rows"),
        (lambda: ProtoSet(np.array([1]), np.zeros((1, 4)), np.array([0])), "counts"),
        (lambda: ProtoSet(np.array([1]), np.full((1, 4), np.nan)), "non-finite"),
        (lambda: ProtoSet(np.array([1]), np.zeros((1, 4)), dt="u1"), "not a float wire dtype"),
        (lambda: Config("x", {"a": {"b": {"c": {"d": {"e": 1}}}}}), "nested deeper than 4"),
        (lambda: Config("x", {"a": np.int64(3)}), "not a plain value"),
        (lambda: Config("x", {"a": float("inf")}), "not finite"),
        (lambda: Config("x", adapter_layout=[("a", (2,)), ("a", (3,))]), "empty or repeated"),
        (lambda: Config("x", class_masks=np.ones((2, 3))), "2-D bool"),
        (lambda: Config("x", limits={"a": -1}), "outside"),
        (lambda: PublicSet(np.zeros((2, 1, 2, 2), np.uint8), np.array([0, 5]), [0, 1]), "not in classes"),
        (lambda: PublicSet(np.zeros((2, 1, 2), np.uint8), np.array([0, 0]), [0]), r"\(n, c, h, w\)"),
        (lambda: PublicSet(np.zeros((2, 1, 2, 2), np.uint8), np.array([0]), [0]), "2 samples but 1 labels"),
        (lambda: RoundStart(-1.0), "deadline"),
        (lambda: RoundStart(1.0, participants=["a/b"]), "not a valid name"),
        (lambda: RoundStart(1.0, final=1), "expected a bool"),  # type: ignore[arg-type]  # on purpose
        (lambda: ParamsUpload(SparseVector(5, np.array([4, 2]), np.ones(2, np.float32)), 1, 0), "increasing"),
        (lambda: ParamsUpload(np.zeros((2, 2), np.float32), 1, 0), "1-D"),
        (lambda: ParamsUpload(np.zeros(2, np.float32), 1, -1), "base_round"),
        (lambda: Metrics(10, 11, 0, 0), "correct_local = 11 exceeds n_local = 10"),
        (lambda: Metrics(10, 1, 5, 0, proto_correct_test=6), "proto_correct_test = 6 exceeds n_test = 5"),
        (lambda: Metrics(10, 1, 5, 0, proto_correct_local=-1), "proto_correct_local"),
        (lambda: Metrics(1, 1, 1, 1, loss=float("nan")), "loss"),
        (lambda: Metrics(1, 1, 1, 1, extra={"x": "y"}), "extra.x"),  # type: ignore[dict-item]  # on purpose
        (lambda: Status(None), "state"),  # type: ignore[arg-type]  # on purpose
    ],
)
def test_constructors_validate(make: Callable[[], object], reason: str) -> None:
    with pytest.raises(WireError, match=reason):
        make()


def test_constructors_normalise() -> None:
    # Lists where arrays and tuples are declared, on purpose: the constructors turn them into those.
    ps = ProtoSet([3, 5], [[1, 2], [3, 4]], [7, 8])  # type: ignore[arg-type]
    assert ps.counts is not None
    assert ps.classes.dtype == np.int64 and ps.values.dtype == np.float32 and ps.counts.dtype == np.int64
    cfg = Config("x", {"t": (1, 2)}, [["a", [2, 3]]])  # type: ignore[list-item]
    assert cfg.params == {"t": [1, 2]} and cfg.adapter_layout == [("a", (2, 3))]
    assert Metrics(1, 1, 1, 1, train_s=2).train_s == 2.0 and isinstance(Metrics(1, 1, 1, 1, train_s=2).train_s, float)


def test_encode_rejects_non_messages_and_bad_envelopes() -> None:
    with pytest.raises(TypeError):
        encode_message({"state": "ok"}, fed="f", sender="s")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown phase"):
        encode_message(Status("ok"), fed="f", sender="s", phase="eval")
    with pytest.raises(ValueError, match="outside"):
        encode_message(Status("ok"), fed="f", sender="s", round=2**31)
    with pytest.raises(ValueError, match="float16"):
        encode_message(Metrics(1, 1, 1, 1, probs=np.full((1, 2), 1e6, np.float32)), fed="f", sender="s")


def test_equality_compares_arrays_by_value() -> None:
    a = protos(2, 4)
    assert a.counts is not None
    b = ProtoSet(a.classes.copy(), a.values.copy(), a.counts.copy())
    assert a == b and a != ProtoSet(a.classes, a.values + 1, a.counts)
    assert ProtoUpload(a, None, 1) != ProtoUpload(a, None, 2)
    with pytest.raises(TypeError):
        hash(a)


# -- lite devices (issue 57): additive keys, each travelling only where it is used ---------------------------------
def _public(**kw: Any) -> PublicSet:
    base: dict[str, Any] = dict(
        x=np.zeros((0, 1, 2, 2), np.uint8),
        y=np.zeros(0, np.int64),
        classes=[],
        backbone=np.arange(8, dtype=np.float32),
        norm=([0.5], [0.25]),
    )
    return PublicSet(**{**base, **kw})


def test_lite_keys_travel_only_where_used() -> None:
    import msgpack

    from protofl.wire import encode_message

    def wire(msg: Message) -> bytes:
        return encode_message(msg, fed="f", sender="s")

    def body(msg: Message) -> dict:
        return msgpack.unpackb(wire(msg), raw=False)["body"]

    assert (
        "trains" not in body(Join(arch="", n_samples=3))
        and body(Join(arch="", n_samples=3, trains=False))["trains"] is False
    )
    assert "lite" not in body(_public())
    layout = [("w", (2, 3)), ("b", (2,))]
    lite = decode_as(PublicSet, wire(_public(graph=b"graph", layout=layout)))
    assert lite.graph == b"graph" and lite.layout == layout
    assert decode_as(Join, wire(Join(arch="", n_samples=3, trains=False))).trains is False
    assert decode_as(Join, wire(Join(arch="", n_samples=3))).trains is True


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda: _public(graph=b"g", layout=[("w", (2, 3))]), "lite layout: 6 values, but the backbone has 8"),
        (lambda: _public(graph=b"g"), "the graph and its layout go together"),
        (lambda: _public(graph=b"g", layout=[("w", (8,))], backbone=None, norm=None), "a graph only with a backbone"),
        (lambda: Join(arch="", n_samples=1, trains="no"), "trains: expected a boolean"),  # type: ignore[arg-type]
    ],
)
def test_lite_fields_are_checked(make: Callable[[], object], reason: str) -> None:
    with pytest.raises(WireError, match=reason):
        make()
