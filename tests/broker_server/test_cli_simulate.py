"""`protofl-server simulate` as a user runs it: JSON report on disk, clear errors with exit code 2."""

from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from broker_server.cli import app

runner = CliRunner()


def test_simulate_writes_the_json_report(tmp_path) -> None:
    out = tmp_path / "r" / "report.json"
    res = runner.invoke(
        app,
        [
            "simulate",
            "--preset",
            "tinyproto",
            "--dataset",
            "synthetic:n=600,n_test=100",
            "--clients",
            "3",
            "--rounds",
            "2",
            "--seed",
            "1",
            "--json",
            str(out),
            "--set",
            "mu=auto",
            "--set",
            "cps_s=32",
            "--device",
            "auto",
        ],
    )
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert report["preset"] == "tinyproto"
    cps = report["config"]["techniques"]["cps"]  # the config names its techniques, each with its options
    assert cps["mu"] == "auto" and cps["cps_s"] == 32
    assert [r["round"] for r in report["rounds"]] == [1, 2]
    assert set(report["totals"]) == {"uplink_bytes", "downlink_bytes", "wall_s", "clipped", "clip_checked"}
    assert report["simulation"]["device"] == ("cuda" if torch.cuda.is_available() else "cpu")  # auto, resolved
    for row in report["rounds"]:
        assert {"local_acc", "local_proto_acc", "global_acc", "global_proto_acc"} <= set(row)
    assert "tinyproto on synthetic" in res.output  # the summary table
    assert "proto" in res.output  # its nearest-prototype columns


def test_bad_input_exits_2_with_a_reason(tmp_path) -> None:
    cases = [
        (["--preset", "nope"], "known: fedavg"),
        (["--dataset", "fashion-mnist", "--data-dir", str(tmp_path / "missing")], "dataset-fashion-mnist"),
        (["--set", "apud_ratio=7"], "apud_ratio"),
        (["--set", "no_equals_sign"], "key=value"),
        (["--dataset", "imagenet"], "unknown dataset spec"),
        (["--config", str(tmp_path / "none.toml")], "not found"),
        (["--device", "tpu"], "--device must be cpu, cuda or auto"),
    ]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "torch sees no CUDA device"))
    for args, fragment in cases:
        res = runner.invoke(app, ["simulate", "-q", *args])
        assert res.exit_code == 2, (args, res.output)
        assert fragment in " ".join(res.output.split()), (args, res.output)


def test_presets_command_lists_every_preset() -> None:
    res = runner.invoke(app, ["presets"])
    assert res.exit_code == 0
    for p in ("fedavg", "fedproto", "refprotofl", "tinyproto", "fedpagr", "protofl"):
        assert p in res.output


def test_onnx_extractor_gives_the_same_report_as_torch(tmp_path) -> None:
    base = [
        "simulate",
        "-q",
        "--preset",
        "fedproto",
        "--dataset",
        "synthetic:n=400,n_test=50",
        "--clients",
        "2",
        "--rounds",
        "1",
        "--arch",
        "mlp",
    ]
    reports = {}
    for ex in ("torch", "onnx"):
        out = tmp_path / f"{ex}.json"
        res = runner.invoke(app, [*base, "--extractor", ex, "--json", str(out)])
        assert res.exit_code == 0, res.output
        reports[ex] = json.loads(out.read_text())
    t, o = reports["torch"]["rounds"][0], reports["onnx"]["rounds"][0]
    assert t["uplink_bytes"] == o["uplink_bytes"]
    assert abs(t["local_acc"] - o["local_acc"]) <= 0.02 and abs(t["global_acc"] - o["global_acc"]) <= 0.02
    bad = runner.invoke(app, [*base, "--extractor", "tensorrt"])
    assert bad.exit_code == 2 and "--extractor must be torch or onnx" in bad.output
