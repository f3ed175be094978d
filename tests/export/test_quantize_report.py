"""What `protofl-export quantize`'s accuracy line measures, in its own words (issue 41): whose model, on which
images of which data, how many of the model's classes they hold, and by which classifier."""

from __future__ import annotations

from export.quantize import QuantReport


def test_the_report_says_what_its_accuracy_measures() -> None:
    device = QuantReport(
        "static",
        0.9,
        0.89,
        2_000_000,
        600_000,
        200,
        100,
        "features",
        model="model.onnx (device dev-3 of federation 'trial' (protofl), 8 round(s) trained)",
        data="imagefolder:/data/dev-3",
        data_origin="the data its run recorded",
        test_classes=3,
        num_classes=10,
    )
    first, second = device.summary().splitlines()
    assert first.startswith(
        "accuracy of model.onnx (device dev-3 of federation 'trial' (protofl), 8 round(s) trained) on 100 images "
        "of the test split of 'imagefolder:/data/dev-3' (the data its run recorded; 3 of 10 classes: only those, "
        "not an accuracy on every class), by nearest prototype, the prototypes the class means of 200 training "
        "images of 'imagefolder:/data/dev-3' through each model (not the prototype table shipped with it)"
    ), first
    assert second == (
        "nearest-prototype accuracy fp32 90.00% -> int8 (static) 89.00% (drop +1.00 points); size 2.00 MB -> 0.60 MB"
    )
    predictor = QuantReport(
        "dynamic",
        0.5,
        0.5,
        1,
        1,
        0,
        60,
        "logits",
        model="global.onnx",
        data="fashion-mnist",
        test_classes=10,
        num_classes=10,
    )
    first, second = predictor.summary().splitlines()
    assert first == (
        "accuracy of global.onnx on 60 images of the test split of 'fashion-mnist' (10 of 10 classes), by its own "
        "class scores (argmax of the logits graph)"
    )
    assert second.startswith("classifier (argmax) accuracy fp32 50.00% -> int8 (dynamic) 50.00%")
