"""protofl/learning.py: the rule that says a federation is not learning, checked by hand."""

from __future__ import annotations

from protofl.learning import LearningWatch, collapse, verdict


def rows(*local: float | None, predictor: tuple[float | None, ...] = ()) -> list[dict]:
    out = []
    for i, v in enumerate(local):
        out.append({"round": i + 1, "local_acc": v, "predictor_acc": predictor[i] if i < len(predictor) else None})
    return out


def test_flat_for_window_plus_one_rounds_is_not_learning() -> None:
    # the FedAvg: local accuracy an unchanging 29.8 % -- 4 rounds (WINDOW 3 after the first) say it
    assert verdict(rows(0.298, 0.298, 0.298)) is None  # too few rounds to say
    note = verdict(rows(0.298, 0.298, 0.298, 0.305))  # +0.7 points: under MIN_GAIN (1 point)
    assert note is not None and "local_acc 29.8 % in round 1, at most 30.5 % in rounds 2-4" in note


def test_any_accuracy_that_rose_a_point_is_learning() -> None:
    assert verdict(rows(0.298, 0.298, 0.298, 0.308)) is None  # +1.0 point in round 4
    # the ridge predictor stays round 1's; the devices' local accuracy rises: learning
    assert verdict(rows(0.5, 0.52, 0.55, 0.6, predictor=(0.8, 0.8, 0.8, 0.8))) is None
    # a plateau after learning is not flagged: round 2 rose above round 1, the rest is flat
    assert verdict(rows(0.5, 0.9, 0.9, 0.9, 0.9, 0.9)) is None
    # unscored rounds (None) are skipped: 4 scored values are needed
    assert verdict(rows(0.3, None, 0.3, None, 0.3)) is None
    # right from round 1: nothing left to gain
    assert verdict(rows(0.995, 0.995, 0.995, 0.995)) is None


def test_collapse_is_one_class_taking_95_percent_of_predictions() -> None:
    labels = [0, 1, 2, 3] * 5
    assert collapse([2] * 20, labels) is not None  # 100 % in class 2, which holds 25 % of the labels
    assert collapse([2] * 19 + [0], labels) is not None  # 95 %
    assert collapse([2] * 18 + [0, 1], labels) is None  # 90 %
    assert collapse([0] * 20, [0] * 19 + [1]) is None  # the labels are that class: a right answer


def test_the_watch_says_it_once() -> None:
    w = LearningWatch()
    said = [w.update(r) for r in rows(0.3, 0.3, 0.3, 0.3, 0.3)]
    assert said[:3] == [None, None, None] and said[3] is not None and said[4] is None
    assert w.note == said[3] and w.note.startswith("round 4: not learning")
    assert LearningWatch().update({"round": 1, "local_acc": 0.9}, collapsed="collapsed: ...") is not None
