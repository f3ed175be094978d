"""What a hostile message costs the receiver: linear decoding, the envelope before the body, and kinds
small by nature refused by their size (issue 24).

Times are CPU seconds of this process (`time.process_time`), best of three, so that other work on the
machine does not count, with the garbage collector paused: its full collections come in steps that
make a small input look cheaper than its share. A linear field decodes 4 times the entries in about 4
times the time, where a quadratic one takes 16 times.
"""

from __future__ import annotations

import functools
import gc
import time
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest

from protofl.errors import WireError
from protofl.wire import (
    DEFAULT_LIMITS,
    DEVICE_KINDS,
    Config,
    Envelope,
    Join,
    Limits,
    Metrics,
    decode_body,
    decode_message,
    encode_message,
    pack_envelope,
    read_header,
)
from tests.wire_helpers import decode_as

# Room for a few hundred thousand entries: the decoder's list and object limits, not its algorithms, would
# otherwise refuse the larger sizes.
ROOMY = Limits(max_list_len=1_000_000, max_objects=10_000_000, max_map_len=1_000_000)


def message(kind: str, body: dict[str, Any], sender: str = "rpi-07") -> bytes:
    """Packed by hand: the typed constructors would run the checks under test on the sending side."""
    return pack_envelope(Envelope(1, kind, "fed", 3, "", sender, "m1", body))


def config(n: int) -> bytes:
    return message(
        "config",
        {
            "preset": "x",
            "params": {},
            "adapter_layout": [[f"w{i}", [2, 3]] for i in range(n)],
            "class_masks": None,
            "mask_shape": None,
            "limits": {},
        },
    )


def round_participants(n: int) -> bytes:
    return message(
        "round",
        {
            "deadline": 1.0,
            "adapter": None,
            "params": None,
            "anchors": None,
            "anchor_kind": "",
            "participants": [f"c{i}" for i in range(n)],
            "final": False,
        },
    )


def params_list(n: int) -> bytes:
    return message(
        "config",
        {
            "preset": "x",
            "params": {"l": [[i, float(i)] for i in range(n)]},
            "adapter_layout": [],
            "class_masks": None,
            "mask_shape": None,
            "limits": {},
        },
    )


def public_classes(n: int) -> bytes:
    x = {"dt": "u1", "sh": [1, 1, 1, 1], "b": b"\0"}
    y = {"dt": "u2", "sh": [1], "b": b"\0\0"}
    return message("public", {"x": x, "y": y, "classes": list(range(n)), "backbone": None})


def cpu_seconds(fn: Callable[[], Any]) -> float:
    best = float("inf")
    for _ in range(3):
        gc.collect()
        gc.disable()
        try:
            start = time.process_time()
            fn()
            best = min(best, time.process_time() - start)
        finally:
            gc.enable()
    return best


@pytest.mark.parametrize(
    "make,small",
    [(config, 25_000), (round_participants, 25_000), (params_list, 25_000), (public_classes, 16_000)],
    ids=["adapter_layout", "participants", "params", "public_classes"],
)
def test_every_long_field_decodes_in_linear_time(make: Callable[[int], bytes], small: int) -> None:
    payloads = {n: make(n) for n in (small, 4 * small)}
    for data in payloads.values():
        decode_message(data, limits=ROOMY)  # valid: the whole body is decoded and checked
    t = {n: cpu_seconds(functools.partial(decode_message, data, limits=ROOMY)) for n, data in payloads.items()}
    assert t[4 * small] < 2.0, t
    assert t[4 * small] < 8 * t[small] + 0.02, t


def test_a_repeated_layout_name_is_still_refused() -> None:
    body: dict[str, Any] = {
        "preset": "x",
        "params": {},
        "adapter_layout": [["a", [1]], ["b", [1]], ["a", [2]]],
        "class_masks": None,
        "mask_shape": None,
        "limits": {},
    }
    with pytest.raises(WireError, match=r"adapter_layout\[2\]: name 'a' is empty or repeated"):
        decode_message(message("config", body))


def test_unknown_keys_are_found_in_linear_time() -> None:
    # 4090 unknown keys (up to the map limit), and the first in sort order is named.
    body: dict[str, Any] = {
        "preset": "x",
        "params": {},
        "adapter_layout": [],
        "class_masks": None,
        "mask_shape": None,
        "limits": {},
        **{f"k{i:05d}": i for i in range(4090)},
    }
    assert cpu_seconds(lambda: pytest.raises(WireError, decode_message, message("config", body))) < 0.5
    with pytest.raises(WireError, match="config: unknown key 'k00000'"):
        decode_message(message("config", body))


def test_the_header_is_read_without_the_body() -> None:
    # A body that would fail to parse (an ext type, a string that is not UTF-8): the header still reads.
    raw = msgpack.packb(
        {
            "v": 1,
            "kind": "protos",
            "fed": "fed",
            "round": 3,
            "phase": "train",
            "sender": "rpi-07",
            "msg_id": "m1",
            "body": {"local": msgpack.ExtType(1, b"x")},
        },
        use_bin_type=True,
    )
    head = read_header(raw)
    assert (head.kind, head.fed, head.round, head.phase, head.sender, head.size) == (
        "protos",
        "fed",
        3,
        "train",
        "rpi-07",
        len(raw),
    )
    with pytest.raises(WireError, match="ext types are not allowed"):
        head.open()


def test_decode_message_is_the_header_then_the_body() -> None:
    data = encode_message(Join(arch="cnn", n_samples=4), fed="fed", sender="rpi-07", round=2)
    env = read_header(data).open()
    assert decode_message(data) == (env, decode_body(env))
    broken = message("join", {"arch": "cnn", "n_samples": -1, "profile": "", "agent_version": "", "token": ""})
    with pytest.raises(WireError, match=r"n_samples: -1 is outside .* \(sender rpi-07, round 3\)$"):
        decode_body(read_header(broken).open())


def test_a_top_level_that_is_not_a_map_is_refused_by_its_first_byte() -> None:
    # A million nested lists would take the parser a while; the first byte already says "list".
    data = b"\x91" * 1_000_000 + b"\xc0"
    assert cpu_seconds(lambda: pytest.raises(WireError, read_header, data)) < 0.05
    with pytest.raises(WireError, match="top level must be a map, got list"):
        read_header(data)


# Over 64 KiB each; join and status packed by hand (their constructors now bound a token and a detail on the sending
# side too: what is under test is the receiver's size check, before any body is parsed).
SMALL_KINDS: dict[str, bytes] = {
    "join": message("join", {"arch": "cnn", "n_samples": 1, "profile": "", "agent_version": "", "token": "t" * 70_000}),
    "status": message("status", {"state": "online", "detail": "d" * 70_000}),
    "metrics": encode_message(
        Metrics(n_local=1, correct_local=0, n_test=1, correct_test=0, probs=np.zeros((1, 36_000), np.float32)),
        fed="fed",
        sender="rpi-07",
    ),
}


@pytest.mark.parametrize("kind", sorted(SMALL_KINDS))
def test_kinds_small_by_nature_are_refused_over_64_kib(kind: str) -> None:
    data = SMALL_KINDS[kind]
    assert 64 * 2**10 < len(data) < DEFAULT_LIMITS.max_message_bytes
    with pytest.raises(WireError, match=f"over the limit of 65536 for a {kind} message"):
        read_header(data)
    raised = Limits(max_join_bytes=2**20, max_status_bytes=2**20, max_metrics_bytes=2**20)
    if kind == "metrics":  # under raised limits it decodes (the others are refused by their field bounds instead)
        assert decode_message(data, limits=raised)[0].kind == kind
    else:
        with pytest.raises(WireError, match="over the limit of 1024"):
            decode_message(data, limits=raised)


def test_the_size_of_a_small_kind_is_checked_before_its_body() -> None:
    # 70 KiB of metrics whose body would not even parse: the size is what refuses it.
    raw = msgpack.packb(
        {
            "v": 1,
            "kind": "metrics",
            "fed": "fed",
            "round": 1,
            "phase": "",
            "sender": "rpi-07",
            "msg_id": "m1",
            "body": {"extra": msgpack.ExtType(1, b"x" * 70_000)},
        },
        use_bin_type=True,
    )
    with pytest.raises(WireError, match="for a metrics message"):
        read_header(raw)


def test_other_kinds_keep_the_message_limit() -> None:
    lim = Limits(max_message_bytes=1000)
    assert [lim.max_bytes(k) for k in ("config", "round", "public", "protos", "adapter")] == [1000] * 5
    assert lim.max_bytes("join") == lim.max_bytes("metrics") == lim.max_bytes("status") == 1000  # never above
    assert DEFAULT_LIMITS.max_bytes("metrics") == 64 * 2**10
    assert decode_as(Config, config(3000)).adapter_layout[-1] == ("w2999", (2, 3))  # ~40 KiB, no kind limit


def test_a_device_body_is_refused_after_a_few_hundred_objects() -> None:
    # A million empty lists in an upload's body: refused while parsing, long before the million.
    raw = msgpack.packb(
        {
            "v": 1,
            "kind": "protos",
            "fed": "fed",
            "round": 1,
            "phase": "train",
            "sender": "rpi-07",
            "msg_id": "m1",
            "body": {"local": [[]] * 90_000},
        },
        use_bin_type=True,
    )
    head = read_header(raw)
    assert cpu_seconds(lambda: pytest.raises(WireError, head.open)) < 0.05
    with pytest.raises(WireError, match="protos body: more than 256 msgpack objects"):
        head.open()
    assert {k: DEFAULT_LIMITS.max_body_objects(k) for k in sorted(DEVICE_KINDS)} == {
        "adapter": 256,
        "join": 64,
        "metrics": 64 + 4096,
        "protos": 256,
        # secure aggregation's steps: a body of one or two byte strings (the boxes, the shares, the keys) or one
        # array, whatever the neighbours' number: the 64 every small body gets
        "sa_keys": 64,
        "sa_masked": 64,
        "sa_shares2": 64,
        "sa_unmask2": 64,
    }
    assert DEFAULT_LIMITS.max_body_objects("config") == DEFAULT_LIMITS.max_objects


def test_metrics_with_the_most_extra_entries_fit_their_budget() -> None:
    from protofl.wire.messages import MAX_MAP_KEYS  # the most a member may send (issue 43)

    extra = {f"e{i}": float(i) for i in range(MAX_MAP_KEYS)}
    msg = Metrics(
        n_local=1,
        correct_local=0,
        n_test=1,
        correct_test=0,
        probs=np.zeros((2, 3), np.float32),
        extra=extra,
        proto_correct_local=0,
        proto_correct_test=0,
    )
    data = encode_message(msg, fed="fed", sender="rpi-07")
    assert decode_message(data, limits=Limits(max_metrics_bytes=2**20))[1] == msg


def test_the_envelope_itself_cannot_be_made_expensive() -> None:
    # A container where the envelope has a scalar, and a top-level map of a million keys: both refused
    # after a few objects or by their count, not parsed whole.
    fields = {"v": 1, "kind": "join", "fed": "fed", "round": 1, "phase": "", "sender": "rpi-07", "body": {}}
    nested = msgpack.packb({**fields, "msg_id": [[]] * 90_000}, use_bin_type=True)
    assert cpu_seconds(lambda: pytest.raises(WireError, read_header, nested)) < 0.05
    with pytest.raises(WireError, match="message envelope: more than 64 msgpack objects"):
        read_header(nested)
    wide = msgpack.packb({**fields, "msg_id": "m", **{f"k{i}": 0 for i in range(1_000_000)}}, use_bin_type=True)
    assert cpu_seconds(lambda: pytest.raises(WireError, read_header, wide)) < 0.05
    with pytest.raises(WireError, match="over the decoder limit"):
        read_header(wide)


def test_secure_aggregations_uploads_at_100_devices_fit_twice_a_tinyproto_upload() -> None:
    # The bytes goal, as wired (envelopes included): at 100 devices SecAgg+ gives each device k = 14
    # neighbours; its four uploads (keys, 14 boxes, the masked table of 10 x (51 + 1) values, 14 shares) against
    # the tinyproto upload they replace (10 classes x 51 values, f4), the same 16-character sender.
    from protofl import secagg
    from protofl.wire import Message, ProtoSet, ProtoUpload, SaKeys, SaMasked, SaShares, SaUnmask, message_size

    me = {"fed": "bench", "sender": "device-000000001", "round": 1, "phase": "train"}
    k = secagg.degree(100)
    tiny = message_size(
        ProtoUpload(ProtoSet.from_table({c: np.ones(51) for c in range(10)}, 51, "f4", None), None, 600), **me
    )
    steps: list[Message] = [
        SaKeys(b"c" * 32, b"s" * 32),
        SaShares([b"x" * secagg.BOX_BYTES] * k),
        SaMasked(np.zeros(10 * 52, np.uint32)),
        SaUnmask([b"y" * secagg.SHARE_BYTES] * k),
    ]
    sizes = [message_size(m, **me) for m in steps]
    assert k == 14 and tiny == 2228
    # each step: its payload plus an envelope of at most 125 bytes (no id, point or nonce rides with an entry)
    payload = [64, k * secagg.BOX_BYTES, 4 * 520, k * secagg.SHARE_BYTES]
    assert all(0 < s - p <= 125 for s, p in zip(sizes, payload, strict=True)), sizes
    assert sum(sizes) <= 2 * tiny, (sizes, tiny)
