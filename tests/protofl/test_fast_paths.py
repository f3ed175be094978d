"""The aggregator's one-pass paths (issue 27) against the per-row / per-element versions they replace."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest

from protofl.algorithms.fedproto import MeanPrototypes, PrototypeAggregator
from protofl.algorithms.robust import NormLog, clip_around, clip_rows, row_dots
from protofl.algorithms.support import reconstruct_table
from protofl.algorithms.unit import ConsensusAggregator
from protofl.errors import WireError
from protofl.sparse import SparseVector
from protofl.wire import ParamsUpload, ProtoSet, ProtoUpload, decode_message, encode_message
from protofl.wire.codec import mask_indices


def _reference(packed: np.ndarray, n: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(packed, count=n, bitorder="little"))


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 2**15 - 1, 2**15, 2**15 + 1, 100_003])
def test_mask_indices_equal_unpackbits_on_random_masks(n: int) -> None:
    rng = np.random.default_rng(n)
    # Densities around the 6-10 % window where the padded path runs, and both ends.
    for density in (0.0, 0.01, 0.059, 0.06, 0.0625, 0.08, 0.1, 0.1001, 0.5, 1.0):
        bits = rng.random(n) < density
        packed = np.packbits(bits, bitorder="little")
        got = mask_indices(packed, n)
        want = _reference(packed, n)
        assert got.dtype == np.int64 and np.array_equal(got, want), (n, density)


def test_mask_indices_at_exactly_ten_percent_and_every_padding_length() -> None:
    # k = n / 10 exactly (APUD's default K) and a few k below it: every padding the formula gives.
    n = 2**15 + 17
    rng = np.random.default_rng(0)
    for k in range(n // 10 - 12, n // 10 + 1):
        idx = np.sort(rng.choice(n, k, replace=False))
        bits = np.zeros(n, dtype=bool)
        bits[idx] = True
        assert np.array_equal(mask_indices(np.packbits(bits, bitorder="little"), n), idx)


def test_a_sparse_upload_in_mask_form_decodes_to_its_indices() -> None:
    d, rng = 70_000, np.random.default_rng(1)
    idx = np.sort(rng.choice(d, d // 10, replace=False))
    sv = SparseVector(d, idx, rng.standard_normal(idx.size).astype(np.float32))
    data = encode_message(ParamsUpload(update=sv, n_samples=5, base_round=0), fed="f", sender="c")
    _, msg = decode_message(data)
    assert isinstance(msg, ParamsUpload) and isinstance(msg.update, SparseVector)
    assert np.array_equal(msg.update.indices, idx) and np.array_equal(msg.update.values, sv.values)


def test_row_dots_equal_np_dot_bit_for_bit() -> None:
    rng = np.random.default_rng(2)
    for w in (1, 3, 51, 512, 700):
        a = rng.standard_normal((9, w)) * 37.0
        b = rng.standard_normal((9, w))
        assert np.array_equal(row_dots(a, b), np.array([np.dot(x, y) for x, y in zip(a, b, strict=True)]))


def test_clip_rows_on_hand_computed_rows() -> None:
    rows = np.array([[3.0, 4.0], [0.3, 0.4], [1.0, 1.0], [0.0, 0.0]])
    centers = np.array([[0.0, 0.0], [0.0, 0.0], [1.0, 0.0], [0.0, 0.0]])
    out, dist, norm = clip_rows(rows, centers, 1.0)
    assert np.array_equal(dist, [5.0, 0.5, 1.0, 0.0]) and np.allclose(norm, [5.0, 0.5, np.sqrt(2), 0.0])
    assert np.allclose(out[0], [0.6, 0.8])  # distance 5, scaled back onto the unit ball around 0
    assert np.array_equal(out[1:], rows[1:])  # within the radius (row 2 exactly on it): as sent


def test_clip_rows_equal_clip_around_row_by_row() -> None:
    rng = np.random.default_rng(3)
    rows = (rng.standard_normal((12, 51)) * rng.uniform(0.1, 10, (12, 1))).astype(np.float32)
    centers = rng.standard_normal((12, 51))
    for radius in (0.5, 3.0, 1e4):
        out, dist, norm = clip_rows(rows, centers, radius)
        log = NormLog()
        for i in range(rows.shape[0]):
            want, d = clip_around(rows[i], centers[i], radius)
            assert np.array_equal(out[i], want) and dist[i] == d
            log.record(rows[i], d, radius)
        assert log.values == norm.tolist()  # the norms NormLog.record takes row by row


def test_norm_log_rows_equal_row_by_row() -> None:
    rng = np.random.default_rng(4)
    rows = rng.standard_normal((7, 33)).astype(np.float32)
    _, dists, norms = clip_rows(rows, rng.standard_normal((7, 33)), 1.0)
    one, many = NormLog(), NormLog()
    for r, d in zip(rows, dists, strict=True):
        one.record(r, float(d), 1.0)
    many.record_rows(norms, dists, 1.0)
    assert one.values == many.values and one.clipped == many.clipped == int((dists > 1.0).sum())


def test_check_rows_refuses_what_the_decoder_cannot_know_and_changes_nothing() -> None:
    acc = PrototypeAggregator(4, 3)
    with pytest.raises(ValueError, match=r"class ids must lie in \[0, 4\)"):
        acc.check_rows(np.array([1, 4]), (2, 3), np.array([1, 1]))
    with pytest.raises(ValueError, match="expected rows of shape"):
        acc.check_rows(np.array([1]), (1, 2), np.array([1]))
    with pytest.raises(ValueError, match="needs the per-class sample counts"):
        acc.check_rows(np.array([1]), (1, 3), None)
    assert acc.senders == 0 and acc.result() == {}


def _random_masks(rng: np.random.Generator, C: int, m: int, s: int) -> tuple[np.ndarray, np.ndarray]:
    """(C, m) class masks of s dims each, and their supports (C, s): each class's dims in ascending order."""
    masks = np.zeros((C, m), dtype=bool)
    for c in range(C):
        masks[c, rng.choice(m, s, replace=False)] = True
    return masks, np.nonzero(masks)[1].reshape(C, s)


def test_unit_rows_on_their_supports_make_the_full_width_sums() -> None:
    rng = np.random.default_rng(6)
    C, m, s = 5, 20, 4
    masks, support = _random_masks(rng, C, m, s)
    prev = rng.standard_normal((C, m))
    full, cut = ConsensusAggregator(prev), ConsensusAggregator(prev)
    for classes in ([0, 1, 2, 3, 4], [1, 3]):
        c = np.asarray(classes)
        values = rng.standard_normal((c.size, s)).astype(np.float32)
        dense = reconstruct_table(dict(zip(classes, values, strict=True)), masks)
        full.add(dense)
        cut.fold_many([c], cut.check_rows(c, values), support, 1)
    (s1, k1), (s2, k2) = full.sums(), cut.sums()
    assert np.array_equal(k1, k2) and np.allclose(s1, s2, rtol=1e-15, atol=1e-15)
    assert np.allclose(full.result(), cut.result())
    with pytest.raises(ValueError, match="class 1 is the zero vector"):
        cut.check_rows(np.array([0, 1]), np.vstack([np.ones(s), np.zeros(s)]))


def test_a_decoded_prototype_set_is_checked_once_and_refused_with_the_constructors_reasons() -> None:
    good = ProtoSet(classes=np.array([0, 2]), values=np.ones((2, 4), np.float32), counts=np.array([3, 4]))
    data = encode_message(ProtoUpload(local=good, public=None, n_samples=7), fed="f", sender="c")
    _, msg = decode_message(data)
    assert isinstance(msg, ProtoUpload) and msg.local == good and msg.local.classes.dtype == np.int64

    def upload(classes: list[int], counts: list[int]) -> bytes:
        body = {
            "c": {"dt": "u2", "sh": [len(classes)], "b": np.asarray(classes, "<u2").tobytes()},
            "v": {"dt": "f4", "sh": [len(classes), 4], "b": np.ones((len(classes), 4), "<f4").tobytes()},
            "n": {"dt": "u4", "sh": [len(counts)], "b": np.asarray(counts, "<u4").tobytes()},
        }
        top = {
            "v": 1,
            "kind": "protos",
            "fed": "f",
            "round": 0,
            "phase": "",
            "sender": "c",
            "msg_id": "x",
            "body": {"local": body, "public": None, "n_samples": 7},
        }
        return msgpack.packb(top, use_bin_type=True)

    with pytest.raises(WireError, match="classes: must be sorted ascending without duplicates"):
        decode_message(upload([2, 0], [1, 1]))
    with pytest.raises(WireError, match="classes: must be sorted ascending without duplicates"):
        decode_message(upload([1, 1], [1, 1]))
    with pytest.raises(WireError, match=r"counts: values must lie in \[1, "):
        decode_message(upload([0, 1], [1, 0]))
    with pytest.raises(WireError, match="2 classes but 3 counts"):
        decode_message(upload([0, 1], [1, 1, 1]))


def test_checked_vector_folds_make_the_sums_add_makes() -> None:
    from protofl.algorithms.apud import ApudAggregator
    from protofl.algorithms.fedavg import FedAvgAggregator

    rng = np.random.default_rng(7)
    d = 50
    apud = [ApudAggregator(rng.standard_normal(d)) for _ in range(2)]
    apud[1]._global = apud[0]._global.copy()
    fedavg = [FedAvgAggregator(d) for _ in range(2)]
    for i in range(4):
        idx = np.sort(rng.choice(d, 9, replace=False))
        sv = SparseVector(d, idx, rng.standard_normal(9).astype(np.float32))
        dense = rng.standard_normal(d).astype(np.float32)
        for j, (a, f) in enumerate(zip(apud, fedavg, strict=True)):
            (a.add if j == 0 else a.add_checked)(sv if i % 2 else dense, 3.0 + i)
            (f.add if j == 0 else f.add_checked)(dense, 3.0 + i)
    assert np.array_equal(apud[0].result(), apud[1].result())
    assert np.array_equal(fedavg[0].result(), fedavg[1].result())
    with pytest.raises(ValueError, match="length 49, expected 50"):
        apud[1].add_checked(SparseVector(49, np.array([1]), np.ones(1, np.float32)), 1.0)
    with pytest.raises(ValueError, match="weight must be a finite number > 0"):
        fedavg[1].add_checked(np.ones(d), 0.0)
    assert apud[1].senders == fedavg[1].senders == 4


@pytest.mark.parametrize("weighting", ["weighted", "mean"])
def test_add_many_makes_the_sums_add_makes_upload_by_upload(weighting: str) -> None:
    rng = np.random.default_rng(8)
    one, many = (PrototypeAggregator(6, 5, weighting) for _ in range(2))
    uploads = []
    for _ in range(40):  # classes repeat across uploads: the case a plain fancy-index += would get wrong
        c = np.sort(rng.choice(6, rng.integers(0, 7), replace=False)).astype(np.int64)
        uploads.append((c, rng.standard_normal((c.size, 5)) * 10.0 ** rng.integers(-3, 4), rng.integers(1, 99, c.size)))
    for c, rows, n in uploads:
        one.add(dict(zip(c.tolist(), rows, strict=True)), dict(zip(c.tolist(), n.tolist(), strict=True)))
    sent = [u for u in uploads if u[0].size]
    many.add_many(
        [u[0] for u in sent], np.concatenate([u[1] for u in sent]), np.concatenate([u[2] for u in sent]), len(uploads)
    )
    assert one.senders == many.senders == 40
    assert np.array_equal(one._sum, many._sum) and np.array_equal(one._weight, many._weight)


def test_fold_many_makes_the_sums_fold_makes_upload_by_upload() -> None:
    rng = np.random.default_rng(10)
    C, m, s = 6, 24, 5
    _, support = _random_masks(rng, C, m, s)
    for cut_rows in (False, True):
        prev = rng.standard_normal((C, m))
        one, many = ConsensusAggregator(prev), ConsensusAggregator(prev)
        classes, units = [], []
        for _ in range(30):
            c = np.sort(rng.choice(C, rng.integers(1, C + 1), replace=False))
            u = many.check_rows(c, rng.standard_normal((c.size, s if cut_rows else m)) * 3.0)
            full = np.zeros((c.size, m))  # the rows scattered to full width, in float64
            if cut_rows:
                full[np.arange(c.size)[:, None], support[c]] = u
            else:
                full = u
            one.fold(list(zip(c.tolist(), full, strict=True)))
            classes.append(c)
            units.append(u)
        many.fold_many(classes, np.concatenate(units), support if cut_rows else None, 31)
        one.fold([])  # an upload without rows counts as a sender
        (s1, k1), (s2, k2) = one.sums(), many.sums()
        assert one.senders == many.senders == 31 and np.array_equal(k1, k2) and np.array_equal(s1, s2)


def _batched_round(
    preset: str, batch: int, monkeypatch: pytest.MonkeyPatch, robust: str = "mean", **overrides: Any
) -> Any:
    """One training phase of 150 random uploads through a preset's batched fold (MeanFold, or the unit
    prototypes' UnitFold), folded `batch` at a time, with clipping at work (a radius that clips some rows,
    non-zero centres)."""
    from broker_server.core.stages import PhaseRun, build_model
    from protofl.algorithms.robust import ClipPolicy
    from protofl.plan import Phase, RoundPlan, Upload
    from protofl.presets import make_config
    from protofl.technique import BatchedFold

    monkeypatch.setattr(BatchedFold, "BATCH", batch)
    cfg = make_config(preset, num_classes=6, proto_dim=40, adapter_rank=2, **overrides)
    plan = RoundPlan.from_config(cfg)
    model = build_model(cfg, plan, ClipPolicy(robust=robust))
    rng = np.random.default_rng(9)
    w = plan.proto_width
    state = model.rules.state_values()
    if "prototypes" in state:
        model.rules.state(MeanPrototypes).prototypes = {
            c: rng.standard_normal(w).astype(np.float32) for c in range(0, 6, 2)
        }
    model.radii["protos"] = 2.5 * np.sqrt(w) if state.get("unit") is None else 1.2  # unit rows: centres of norm <= 1
    run = PhaseRun(model, Phase.TRAIN)
    protos = [f for f in run.folds if Upload.PROTOS in f.kinds]  # (the ridge predictor's fold takes the other kind)
    assert len(protos) == 1 and isinstance(protos[0], BatchedFold)
    for i in range(150):
        c = np.sort(rng.choice(6, rng.integers(0, 7), replace=False))
        values = (rng.standard_normal((c.size, w)) * rng.uniform(0.5, 4.0)).astype(np.float32)
        counts = rng.integers(1, 60, c.size) if i % 7 else None
        if counts is None and cfg.aggregation == "weighted" and not cfg.scaling:
            counts = np.ones(c.size, np.int64)  # weighted means refuse a set without counts, even an empty one
        run.add(
            Upload.PROTOS,
            ProtoUpload(local=ProtoSet(classes=c, values=values, counts=counts), public=None, n_samples=10),
        )
    part = run.partial()  # the float64 sums themselves (the prototypes are float32: a last bit may hide there)
    run.finish()
    return model, part


def _same_tree(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_tree(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return bool(a == b)


@pytest.mark.parametrize(
    ("preset", "overrides"),
    [
        ("fedproto", {}),
        ("fedproto", {"aggregation": "mean"}),
        ("tinyproto", {}),
        ("tinyproto", {"scaling": False}),
        ("protofl", {}),
        ("protofl", {"cps": False}),
    ],
)
def test_a_batched_fold_folds_as_upload_by_upload_bit_for_bit(
    preset: str, overrides: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    (one, one_sums), (many, many_sums) = (_batched_round(preset, b, monkeypatch, **overrides) for b in (1, 64))
    assert _same_tree(one_sums, many_sums)  # 150 uploads: two full batches of 64 and a part
    assert one.round_clips.clipped.get("protos", 0) > 0  # the radius clipped some rows: clipping was at work
    assert one.round_clips == many.round_clips and one.radii == many.radii
    one_, many_ = one.rules.state_values(), many.rules.state_values()
    assert (
        np.array_equal(one_["unit"], many_["unit"])
        if one_.get("unit") is not None
        else one_["prototypes"].keys() == many_["prototypes"].keys() == set(range(6))
    )
    assert all(np.array_equal(v, many_["prototypes"][c]) for c, v in one_.get("prototypes", {}).items())


def test_a_batched_robust_mean_fold_folds_as_upload_by_upload(monkeypatch: pytest.MonkeyPatch) -> None:
    (one, one_sums), (many, many_sums) = (_batched_round("fedproto", b, monkeypatch, robust="median") for b in (1, 64))
    assert _same_tree(one_sums, many_sums)
    one_, many_ = one.rules.state(MeanPrototypes).prototypes, many.rules.state(MeanPrototypes).prototypes
    assert all(np.array_equal(one_[c], many_[c]) for c in one_)
