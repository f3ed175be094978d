"""int8 quantisation of an exported model with onnxruntime, and what it costs in accuracy.

* ``dynamic``: weights int8 ahead of time, activations quantised on the fly. Only MatMul/Gemm are
  quantised: ORT's dynamic ConvInteger kernel is slower than its fp32 convolution on x86 (measured:
  about 5x at batch 64 for ``cnn``), so quantising convolutions dynamically makes a model smaller but slower.
* ``static``: weights and activations int8 (QDQ format, per-channel weights), activation ranges
  calibrated on real images through a ``CalibrationDataReader`` (:func:`calibration_reader`);
  convolutions run as int8 kernels.

The accuracy report measures the model's own accuracy, fp32 and int8, on the test images of the data it
is given (`--data`, else the data its run recorded: for a device's model that is the device's own data,
so only the classes that device holds). A features graph classifies by nearest prototype, with the
prototypes the class means of training images of the same data *through each model* (the fp32 one and the
int8 one), as a device would after switching models, not the prototype table shipped with the model; a
logits graph (a federation's global predictor) by its own argmax. `QuantReport.summary` says all of that.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from edge_agent.inference.onnx_runtime import embed_onnx, session
from protofl.algorithms.prototypes import local_prototypes, nearest_prototype
from protofl.errors import ConfigError

if TYPE_CHECKING:  # onnxruntime is optional at import time
    from onnxruntime.quantization import CalibrationDataReader

__all__ = [
    "MODES",
    "QuantReport",
    "calibration_reader",
    "classifier_accuracy",
    "compare_accuracy",
    "prototype_accuracy",
    "quantize_model",
]

MODES = ("dynamic", "static")
log = logging.getLogger("protofl.export")


def calibration_reader(input_name: str, x: np.ndarray, batch_size: int = 64) -> CalibrationDataReader:
    """A CalibrationDataReader feeding batches of real (normalised) images ``x`` to ``quantize_static``.

    Built inside a function so that importing this module does not need onnxruntime.
    """
    from onnxruntime.quantization import CalibrationDataReader

    class ArrayCalibrationReader(CalibrationDataReader):
        def __init__(self) -> None:
            self._batches: Iterator[dict[str, np.ndarray]] = iter(
                {input_name: np.ascontiguousarray(x[i : i + batch_size], dtype=np.float32)}
                for i in range(0, len(x), batch_size)
            )

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self._batches, None)

    return ArrayCalibrationReader()


def _preprocess(src: Path, dst: Path) -> None:
    """Shape inference + graph clean-up before quantising (onnxruntime's recommendation)."""
    import onnx
    from onnxruntime.quantization import quant_pre_process

    try:
        quant_pre_process(str(src), str(dst))
    except Exception as exc:  # noqa: BLE001 -- the fallback below is always valid, just less optimised
        log.warning("quant_pre_process failed (%s); quantising without it", exc)
        proto = onnx.load(str(src))
        # The dynamo exporter records intermediate shapes that the quantiser's own shape inference
        # can contradict after it rewrites MatMuls; dropping them lets it infer afresh.
        del proto.graph.value_info[:]
        onnx.save(proto, str(dst))


def quantize_model(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    mode: str = "dynamic",
    calibration: np.ndarray | None = None,
) -> Path:
    """Write an int8 version of ``src`` to ``dst``; ``static`` needs ``calibration`` images (n, c, h, w)."""
    if mode not in MODES:
        raise ConfigError(f"--mode must be one of {', '.join(MODES)}, got {mode!r}")
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_dynamic, quantize_static

    src_p, dst_p = Path(src), Path(dst)
    if not src_p.is_file():
        raise ConfigError(f"ONNX model {src_p} does not exist; export one with `protofl-export onnx --out {src_p}`")
    if mode == "static" and (calibration is None or len(calibration) == 0):
        raise ConfigError(
            "static quantisation needs calibration images: pass --data (fashion-mnist, npz:PATH "
            "or idx:DIR) or use --mode dynamic"
        )
    dst_p.parent.mkdir(parents=True, exist_ok=True)
    meta = {e.key: e.value for e in onnx.load(str(src_p), load_external_data=False).metadata_props}
    with tempfile.TemporaryDirectory() as tmp:
        pre = Path(tmp) / "pre.onnx"
        _preprocess(src_p, pre)
        quiet = logging.getLogger().level
        logging.getLogger().setLevel(logging.ERROR)  # the quantiser logs its pre-processing advice at WARNING
        try:
            if mode == "dynamic":
                quantize_dynamic(
                    str(pre), str(dst_p), op_types_to_quantize=["MatMul", "Gemm"], weight_type=QuantType.QInt8
                )
            else:
                assert calibration is not None  # static mode without images was refused above
                name = onnx.load(str(pre), load_external_data=False).graph.input[0].name
                quantize_static(
                    str(pre),
                    str(dst_p),
                    calibration_reader(name, calibration),
                    quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QUInt8,
                    weight_type=QuantType.QInt8,
                    per_channel=True,
                    calibrate_method=CalibrationMethod.MinMax,
                )
        finally:
            logging.getLogger().setLevel(quiet)
    proto = onnx.load(str(dst_p))
    meta["quantization"] = f"{mode}-int8"
    del proto.metadata_props[:]
    for key, value in meta.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.save(proto, str(dst_p))
    return dst_p


@dataclass(frozen=True)
class QuantReport:
    mode: str
    fp32_acc: float
    int8_acc: float
    fp32_bytes: int
    int8_bytes: int
    n_train: int
    n_test: int
    what: str = "features"
    # what was measured, in words: the model (its file, and what it is where its metadata says) and the data
    model: str = ""
    data: str = ""
    data_origin: str = ""  # "--data", "the data its run recorded", "" (the default)
    test_classes: int = 0  # classes present among the test images
    num_classes: int = 0  # classes the model tells apart (else the data's)

    @property
    def drop_points(self) -> float:
        """Accuracy lost, in percentage points (negative: int8 did better)."""
        return 100.0 * (self.fp32_acc - self.int8_acc)

    def measured(self) -> str:
        """One line: whose accuracy, on which images, by which classifier."""
        classes = f"{self.test_classes} of {self.num_classes} classes"
        if self.test_classes < self.num_classes:
            classes += ": only those, not an accuracy on every class"
        data = f"'{self.data}'" if self.data else "the data"
        origin = f"{self.data_origin}; " if self.data_origin else ""
        how = (
            "by its own class scores (argmax of the logits graph)"
            if self.what == "logits"
            else f"by nearest prototype, the prototypes the class means of {self.n_train} training images of "
            f"{data} through each model (not the prototype table shipped with it)"
        )
        return (
            f"accuracy of {self.model or 'the model'} on {self.n_test} images of the test split of {data} "
            f"({origin}{classes}), {how}"
        )

    def summary(self) -> str:
        name = "classifier (argmax) accuracy" if self.what == "logits" else "nearest-prototype accuracy"
        return (
            f"{self.measured()}\n{name} fp32 {100 * self.fp32_acc:.2f}% -> int8 ({self.mode}) "
            f"{100 * self.int8_acc:.2f}% (drop {self.drop_points:+.2f} points); size "
            f"{self.fp32_bytes / 1e6:.2f} MB -> {self.int8_bytes / 1e6:.2f} MB"
        )


def prototype_accuracy(
    model: str | os.PathLike[str],
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    num_classes: int,
    threads: int | None = None,
) -> float:
    """Accuracy of nearest-prototype classification with prototypes from (x_train, y_train) via ``model``."""
    sess = session(model, threads)
    protos, _ = local_prototypes(embed_onnx(sess, x_train), y_train, num_classes)
    pred = nearest_prototype(embed_onnx(sess, x_test), protos)
    return float((pred == y_test).mean()) if len(y_test) else 0.0


def classifier_accuracy(
    model: str | os.PathLike[str], x_test: np.ndarray, y_test: np.ndarray, threads: int | None = None
) -> float:
    """Accuracy of a logits graph's own argmax (a federation's global predictor)."""
    pred = embed_onnx(session(model, threads), x_test).argmax(1)
    return float((pred == y_test).mean()) if len(y_test) else 0.0


def compare_accuracy(
    fp32: str | os.PathLike[str],
    int8: str | os.PathLike[str],
    mode: str,
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    num_classes: int,
    threads: int | None = None,
    what: str = "features",
    *,
    model: str = "",
    data: str = "",
    data_origin: str = "",
    model_classes: int | None = None,
) -> QuantReport:
    """Accuracy through the fp32 and the int8 model, on the same images: by nearest prototype (prototypes
    from the training images through each model), or for a logits graph by its argmax. `model`, `data` and
    `data_origin` name them in the report's words, and `model_classes` (the classes the model tells apart,
    where its metadata says: a device's data may hold fewer) how many of them the test images cover."""
    if what == "logits":
        a32, a8 = classifier_accuracy(fp32, x_test, y_test, threads), classifier_accuracy(int8, x_test, y_test, threads)
    else:
        a32 = prototype_accuracy(fp32, x_train, y_train, x_test, y_test, num_classes, threads)
        a8 = prototype_accuracy(int8, x_train, y_train, x_test, y_test, num_classes, threads)
    return QuantReport(
        mode,
        a32,
        a8,
        os.path.getsize(fp32),
        os.path.getsize(int8),
        len(y_train),
        len(y_test),
        what,
        model=model or Path(fp32).name,
        data=data,
        data_origin=data_origin,
        test_classes=len(np.unique(y_test)),
        num_classes=model_classes or num_classes,
    )
