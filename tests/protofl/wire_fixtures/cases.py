"""The wire fixture cases: one message (plus its envelope) per case, built in this one place.

`record.py` encodes them into `<name>.msgpack` and `tests/protofl/test_wire_fixtures.py` checks the
codec against those bytes, both ways. Inputs are small literals chosen to survive every wire dtype
exactly (f2 halves and quarters, q8 values on a grid of step 0.5), so a decoded fixture equals its
case field for field and the decoder is checked as strictly as the encoder.

Adding a case is always fine (record it alone: `record.py NAME`). Changing an existing case's message
or envelope changes its bytes: do that only together with an intended, versioned wire change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from protofl.sparse import SparseVector
from protofl.traits import Traits
from protofl.wire import (
    Config,
    Join,
    Metrics,
    ModelUpdate,
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
    encode_message,
)

FED = "fed-a"
SERVER = "server"
DEVICE = "dev-01"
MSG_ID = "00c0ffee00c0ffee"  # the shape uuid4().hex[:16] gives a live message


@dataclass(frozen=True)
class Case:
    """A message and the envelope it travels in."""

    msg: Any
    sender: str = DEVICE
    round: int = 3
    phase: str = "train"
    fed: str = FED
    msg_id: str = MSG_ID

    @property
    def kind(self) -> str:
        return self.msg.KIND

    def encode(self) -> bytes:
        return encode_message(
            self.msg, fed=self.fed, sender=self.sender, round=self.round, phase=self.phase, msg_id=self.msg_id
        )


def _f(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


# Every value is a multiple of 0.25 below 2048: exact in f4 and f2.
DENSE = _f(-1.5, -0.25, 0.0, 0.75, 2.0, 3.25)
# Min -1 and max 126.5: q8 scale (126.5 + 1) / 255 = 0.5 and zero 2 are exact, and so is every value.
Q8 = _f(-1.0, 0.5, 3.0, 126.5, 10.0, 0.0)
CONSTANT = _f(0.75, 0.75, 0.75, 0.75)  # q8's constant branch: q = 0, scale 1, zero -0.75


def _protos(dt: str, counts: bool, classes: tuple[int, ...] = (0, 3, 7), width: int = 4) -> ProtoSet:
    k = len(classes)
    # -1, -0.5, 0, ... and 126.5 last: on Q8's grid, so exact in every dtype (see Q8)
    values = np.arange(k * width, dtype=np.float32) * 0.5 - 1.0
    values[-1:] = 126.5
    values = values.reshape(k, width)
    n = np.array([12, 1, 300][:k], dtype=np.int64) if counts else None
    return ProtoSet(np.array(classes, dtype=np.int64), values, n, dt)


def _cases() -> dict[str, Case]:
    masks = np.zeros((3, 5), dtype=bool)  # 15 bits: the last packed byte is partial
    masks[0, :2] = masks[1, 2] = masks[2, 4] = True
    public_u1 = np.array([0, 1, 128, 255, 7, 64, 200, 33], dtype=np.uint8).reshape(2, 1, 2, 2)
    public_f4 = (np.arange(12, dtype=np.float32).reshape(3, 1, 2, 2) - 6.0) * 0.125
    return {
        # --- join: a device announces itself
        "join_full": Case(Join("cnn", 1200, profile="rpi4", agent_version="0.3.1", token="t0k"), phase="", round=0),
        "join_defaults": Case(Join("resnet18", 0), phase="", round=0),
        "join_traits": Case(
            Join("cnn", 1200, profile="rpi4+lte", traits=Traits("lte", ("field-a", "roof"), "battery", 80)),
            phase="",
            round=0,
        ),
        # --- config: the retained federation configuration
        "config_minimal": Case(Config("fedproto"), sender=SERVER, phase="", round=0),
        "config_full": Case(
            Config(
                "tinyproto",
                {
                    "lr": 0.01,
                    "rounds": 50,
                    "neg": -3,
                    "big": 2**40,
                    "mu": "auto",
                    "on": True,
                    "off": None,
                    "stages": ["cps", "scaling"],
                    "nested": {"a": [1, None, False, 2.5]},
                },
                [("adapter.down", (4, 8)), ("adapter.up", (8, 4)), ("head.bias", (10,)), ("scalar", ())],
                masks,
                {"max_upload_bytes": 65536, "max_elements": 1 << 24},
            ),
            sender=SERVER,
            phase="",
            round=0,
        ),
        # --- public: the server's public set
        "public_u1": Case(PublicSet(public_u1, np.array([0, 3]), [0, 3]), sender=SERVER, phase="", round=0),
        "public_f4": Case(PublicSet(public_f4, np.array([1, 1, 4]), [1, 2, 4]), sender=SERVER, phase="", round=0),
        # the shared backbone of the ridge predictor (additive within version 1: the key travels only with one)
        "public_backbone": Case(
            PublicSet(
                public_u1[:0],
                np.zeros(0, np.int64),
                [],
                backbone=np.array([0.5, -1.25, 3.0], np.float32),
                norm=([0.25], [0.5]),
            ),
            sender=SERVER,
            phase="",
            round=0,
        ),
        # --- round: opens a round phase
        "round_minimal": Case(RoundStart(0.0), sender=SERVER, phase="proto", round=1),
        "round_anchors_f4": Case(
            RoundStart(
                1700000000.5,
                adapter=DENSE,
                targets=_protos("f4", counts=False),
                target_label="cps",
                participants=[DEVICE, "jetson.02"],
            ),
            sender=SERVER,
            phase="train",
        ),
        "round_anchors_counts_f2": Case(
            RoundStart(42.25, targets=_protos("f2", counts=True), target_label="erpa", participants=[]),
            sender=SERVER,
            phase="proto",
        ),
        "round_params_final_f2": Case(
            RoundStart(12.5, params=DENSE, final=True, dt="f2"), sender=SERVER, phase="done", round=50
        ),
        # the final message with the ridge predictor's head (additive within version 1: the key travels only with one)
        "round_final_predictor": Case(
            RoundStart(
                7.0,
                final=True,
                predictor=(np.array([[0.5, -1.0], [2.0, 0.25], [0.0, 1.5]], np.float32), np.array([1, -2, 0.5])),
            ),
            sender=SERVER,
            phase="done",
            round=3,
        ),
        # the ridge predictor's route: g's last change (and, after a device said it is behind, all of g); additive
        # within version 1: the key travels only with it
        "round_model_update": Case(
            RoundStart(
                30.0,
                model=ModelUpdate(4, SparseVector(6, np.array([1, 4]), np.array([0.5, -2.0], np.float32))),
            ),
            sender=SERVER,
            phase="train",
            round=5,
        ),
        "round_final_model_dense": Case(
            RoundStart(
                8.0,
                final=True,
                predictor=(np.array([[0.5, -1.0]], np.float32), np.array([1.0], np.float32)),
                model=ModelUpdate(
                    2,
                    SparseVector(6, np.array([0]), np.array([3.0], np.float32)),
                    np.array([3.0, 0.0, 0.5, 1.0, 0.5, -1.0], np.float32),
                ),
            ),
            sender=SERVER,
            phase="done",
            round=9,
        ),
        "round_adapter_params_q8": Case(
            RoundStart(
                99.0, adapter=Q8, params=CONSTANT, targets=_protos("q8", counts=False), target_label="pagr", dt="q8"
            ),
            sender=SERVER,
            phase="train",
        ),
        # --- protos: a client's prototypes
        "protos_counts_f4": Case(ProtoUpload(_protos("f4", counts=True), None, 313), phase="proto"),
        "protos_no_counts_f2": Case(ProtoUpload(_protos("f2", counts=False), None, 40), phase="proto"),
        "protos_public_q8": Case(
            ProtoUpload(_protos("q8", counts=True), _protos("q8", counts=False, classes=(1, 2)), 313), phase="proto"
        ),
        "protos_empty": Case(ProtoUpload(_protos("f4", counts=True, classes=()), None, 0), phase="proto"),
        "protos_none": Case(ProtoUpload(None, None, 0), phase="proto"),
        # --- adapter: a client's adapter after local training, dense or sparse (index or mask form)
        "adapter_dense_f4": Case(ParamsUpload(DENSE, 313, 2)),
        "adapter_dense_f2": Case(ParamsUpload(DENSE, 313, 2, dt="f2")),
        "adapter_dense_q8": Case(ParamsUpload(Q8, 313, 2, dt="q8")),
        "adapter_dense_q8_constant": Case(ParamsUpload(CONSTANT, 313, 2, dt="q8")),
        "adapter_sparse_index_u2_f4": Case(
            ParamsUpload(SparseVector(100, np.array([3, 17, 99]), _f(0.5, -2.0, 7.25)), 313, 2)
        ),
        "adapter_sparse_index_u4_f2": Case(
            ParamsUpload(SparseVector(70000, np.array([0, 65536]), _f(-0.75, 1.5)), 313, 2, dt="f2")
        ),
        "adapter_sparse_mask_q8": Case(
            ParamsUpload(
                SparseVector(20, np.arange(0, 20, 2), _f(-1.0, 0.5, 3.0, 126.5, 10.0, 0.0, 2.0, 2.5, 4.0, -0.5)),
                313,
                2,
                dt="q8",
            )
        ),
        "adapter_sparse_empty_f4": Case(ParamsUpload(SparseVector(8, np.array([], np.int64), _f()), 0, 0)),
        # --- metrics: a client's evaluation
        "metrics_minimal": Case(Metrics(100, 90, 50, 40), phase="done"),
        "metrics_full": Case(
            Metrics(
                100,
                90,
                50,
                40,
                probs=np.array([[0.25, 0.75, 0.0], [0.5, 0.125, 0.375]], dtype=np.float32),
                train_s=3.5,
                loss=-0.125,
                extra={"off_mask_energy": 0.25, "steps": 12.0},
                proto_correct_local=80,
                proto_correct_test=35,
            ),
            phase="done",
        ),
        # --- status: retained status / presence
        "status_state": Case(Status("online"), phase="", round=0),
        "status_detail": Case(Status("training", "round 3 of 50"), sender=SERVER),
        "status_traits": Case(Status("online", "rpi3+nb-iot", Traits("nb-iot", (), "mains")), phase="", round=0),
        # --- pace: the server tells one device (on its down/<id>) it is not in a round, and when to come back
        "pace_until": Case(
            Pace(1767225600.5, "link nb-iot: ~412 s for this round, deadline 120 s"),
            sender=SERVER,
            round=3,
            phase="train",
        ),
        # --- resend: the server asks one device (on its down/<id>) for what the broker dropped
        "resend_uploads": Case(Resend("uploads"), sender=SERVER, round=4, phase="train"),
        "resend_join": Case(Resend("join"), sender=SERVER, phase="", round=0),
        # --- secure aggregation (protofl/secagg.py): a device's four steps on up/, the server's three on down/<id>
        "sa_keys": Case(SaKeys(bytes(range(32)), bytes(range(32, 64))), round=2, phase="train"),
        # (the second forms of five kinds: ids only in the roster, whose order the later lists follow; 32-byte
        # shares; the first forms, retired before any release, have no case)
        "sa_roster2": Case(
            SaRoster(
                {"dev-03": (bytes([2]) * 32, bytes([3]) * 32), "dev-02": (bytes(32), bytes([1]) * 32)},
                t=2,
                frac_bits=17,
                bound=10000.0,
                weighted=True,
            ),
            sender=SERVER,
            round=2,
            phase="train",
        ),
        "sa_shares2": Case(SaShares([bytes([7]) * 80, bytes([8]) * 80]), round=2, phase="train"),
        "sa_routed2": Case(SaRouted([1], [bytes([9]) * 80]), sender=SERVER, round=2, phase="train"),
        "sa_routed2_none": Case(SaRouted([], []), sender=SERVER, round=2, phase="train"),
        "sa_masked": Case(SaMasked(np.array([0, 1, 2**32 - 1], dtype=np.uint32)), round=2, phase="train"),
        "sa_masked_blame": Case(SaMasked(np.array([5, 6], dtype=np.uint32), blame=[0, 9]), round=2, phase="train"),
        "sa_survivors2": Case(SaSurvivors([0, 1, 9]), sender=SERVER, round=2, phase="train"),
        "sa_unmask2": Case(SaUnmask([bytes([3]) * 32, bytes([4]) * 32]), round=2, phase="train"),
    }


CASES: dict[str, Case] = _cases()
