"""Who takes part (issue 47): a run's selection by device traits, and devices left out of a round they cannot
finish, told when to come back - end to end through `protofl-server start` and three `protofl-edge join`
processes on a real Mosquitto; and the draw itself, deterministic per seed and round."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from broker_server.core.selection import Selection
from protofl.errors import ConfigError
from protofl.presets import make_config
from protofl.traits import Traits
from protofl.wire import Join

ROOT = Path(__file__).resolve().parents[2]


def _command(module: str, log: Path, args: list[str]) -> subprocess.Popen[bytes]:
    """`module` as a process, its output in `log` (a file: a pipe nobody reads while the others run fills up)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "-m", module, *args], stdout=out, stderr=subprocess.STDOUT, env=env)


def test_a_run_selects_by_tag_and_leaves_out_a_link_that_cannot_finish(tmp_path: Path) -> None:
    """`--set select=tag:field-a` with `select_fit`: cam-a (field-a, rpi4+wifi) takes part; cam-b (field-a, but an
    rpi3 on NB-IoT: 10 reference seconds of compute are ~125 s there, past the 60 s deadline) and cam-c (no
    field-a tag) are left out of every round, each told why and when to come back; every device finishes."""
    from broker_server.ops.broker import free_port

    port = free_port()
    state = tmp_path / "state"
    server = _command(
        "broker_server.cli",
        tmp_path / "server.log",
        ["start", "--local-broker", "mosquitto", "--insecure", "--port", str(port), "--fed", "sel"]
        + ["--preset", "tinyproto", "--rounds", "2", "--min-clients", "3", "--round-timeout", "60"]
        + ["--set", "select=tag=field-a"]
        + ["--set", "select_fit=true", "--set", "select_compute_s=10", "--state-dir", str(state)],
    )
    devices = {}
    for cid, tags, profile in (
        ("cam-a", ["field-a", "roof"], "rpi4+wifi"),
        ("cam-b", ["field-a"], "rpi3+nb-iot"),
        ("cam-c", ["field-b"], "rpi4+wifi"),
    ):
        args = ["join", "--broker", f"mqtt://127.0.0.1:{port}", "--fed", "sel", "--client-id", cid]
        args += ["--data", "synthetic", "--arch", "mlp", "--threads", "1", "--connect-timeout", "60"]
        args += ["--profile", profile] + [x for t in tags for x in ("--tag", t)]
        devices[cid] = _command("edge_agent.cli", tmp_path / f"{cid}.log", args)
    outs: dict[str, str] = {}
    try:
        for cid, p in devices.items():
            p.wait(timeout=150)
            outs[cid] = (tmp_path / f"{cid}.log").read_text()
            assert p.returncode == 0, f"{cid} exited {p.returncode}:\n{outs[cid][-3000:]}"
        server.wait(timeout=60)
        assert server.returncode == 0, (tmp_path / "server.log").read_text()[-3000:]
    finally:
        for p in (server, *devices.values()):
            if p.poll() is None:
                p.kill()
    rounds = [json.loads(line) for line in (state / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2]
    for r in rounds:
        assert r["selected"] == ["cam-a"] and r["clients"] == ["cam-a"], r
        assert sorted(r["left_out"]) == ["cam-b", "cam-c"], r
        assert "cannot finish by the deadline" in r["left_out"]["cam-b"] and "rpi3+nb-iot" in r["left_out"]["cam-b"]
        assert "deadline 60 s" in r["left_out"]["cam-b"]
        assert r["left_out"]["cam-c"] == "not selected by select=tag=field-a"
    # Told when to come back, on their own down/ topic, every round; the chosen device never is.
    for cid in ("cam-b", "cam-c"):
        said = [line for line in outs[cid].splitlines() if "the server expects us back at" in line]
        assert [f"not in round {r}" in line for r, line in zip((1, 2), said, strict=True)] == [True, True], outs[cid]
    assert "expects us back" not in outs["cam-a"]


def _members() -> dict[str, Join]:
    fleet = {f"lte-{i}": ("rpi4+lte", ("field-a",)) for i in range(4)}
    fleet |= {f"nb-{i}": ("rpi3+nb-iot", ("field-a",)) for i in range(4)}
    fleet |= {f"wifi-{i}": ("jetson-orin-nano+wifi", ("lab",)) for i in range(2)}
    return {c: Join("cnn", 100, profile=p, traits=Traits(p.split("+")[1], tags)) for c, (p, tags) in fleet.items()}


def test_the_draw_is_a_function_of_seed_and_round_with_over_selection_and_a_minimum() -> None:
    members = _members()
    cfg = make_config("tinyproto", select="tag:field-a", select_target=2, select_over=1.5, seed=3)
    sel = Selection(cfg)
    first = sel.choose(1, members, 1000, {})
    assert len(first.chosen) == 3  # ceil(2 x 1.5) of the 8 tagged field-a
    assert all(c.startswith(("lte", "nb")) for c in first.chosen)
    assert first == Selection(cfg).choose(1, dict(reversed(members.items())), 1000, {})  # order-free, repeatable
    assert {sel.choose(r, members, 1000, {}).chosen for r in range(1, 9)} != {first.chosen}  # rounds differ
    assert all(why.startswith("not drawn") for c, why in first.left_out.items() if not c.startswith("wifi"))
    # select_fit: NB-IoT's 62.5 kb/s cannot carry 1 MB up within 60 s; select_min takes the fastest of them back
    fit = make_config("tinyproto", select_fit=True, round_timeout=60.0, select_min=7)
    chosen = Selection(fit).choose(1, members, 1000, {c: 1_000_000 for c in members}).chosen
    assert sorted(c for c in chosen if c.startswith("nb")) == ["nb-0"] and len(chosen) == 7
    with pytest.raises(ConfigError, match="select_min"):
        make_config("tinyproto", select_target=2, select_min=3)


def test_select_fit_leaves_out_the_stragglers_whatever_the_deadline() -> None:
    """select_fit_ratio: a member estimated slower than 2 x the pool's median is left out even where the deadline
    is far (here the default): the bench fleet's rpi3s on NB-IoT (~8 s of compute + ~0.3 s of link) against the
    median rpi4 on LTE (~4 s); 0 switches the rule off."""
    members = _members()
    cfg = make_config("tinyproto", select_fit=True, select_compute_s=1.0)
    choice = Selection(cfg).choose(1, members, 2000, {c: 2000 for c in members})
    assert sorted(choice.left_out) == [f"nb-{i}" for i in range(4)]
    assert all(why.startswith("a straggler") and "2 x the median" in why for why in choice.left_out.values())
    off = make_config("tinyproto", select_fit=True, select_compute_s=1.0, select_fit_ratio=0)
    assert Selection(off).choose(1, members, 2000, {c: 2000 for c in members}).left_out == {}
    with pytest.raises(ConfigError, match="select_fit_ratio"):
        make_config("tinyproto", select_fit_ratio=0.5)


def test_the_compute_estimate_scales_with_the_samples_a_device_reports() -> None:
    """Hand-computed (select_compute_s 1, 2,000 B down and up): the median member holds 100 samples; a typical
    member's time is the median of the members' estimates at 100 samples: an rpi4 on LTE, 0.05 + 16,000 / 30e6 +
    16,000 / 8e6 + 1 / 0.25 = 4.0525 s, so the bar is 8.105 s. The rpi4 holding 210 samples needs 2.1 x 4 + 0.0525 =
    8.4525 s: a straggler. The rpi3s on NB-IoT holding 30 each need 1.6 + 16,000 / 27,200 + 16,000 / 62,500 + 0.3 x
    12.5 = 6.194 s: kept (at 100 samples they would not be: 14.94 s)."""
    members = _members()
    samples = {"lte-3": 210} | {f"nb-{i}": 30 for i in range(4)}
    members = {c: dataclasses.replace(j, n_samples=samples.get(c, 100)) for c, j in members.items()}
    sel = Selection(make_config("tinyproto", select_fit=True, select_compute_s=1.0))
    assert sel.estimate(members["lte-3"], 2000, 2000, 2.1) == pytest.approx(0.05 + 16_000 / 30e6 + 16_000 / 8e6 + 8.4)
    nb = 1.6 + 16_000 / 27_200 + 16_000 / 62_500
    assert sel.estimate(members["nb-0"], 2000, 2000, 0.3) == pytest.approx(nb + 3.75)
    choice = sel.choose(1, members, 2000, {c: 2000 for c in members})
    assert list(choice.left_out) == ["lte-3"]
    assert "(210 samples)" in choice.left_out["lte-3"] and "~4.1 s" in choice.left_out["lte-3"]
    assert len(choice.chosen) == 9


def test_a_presence_with_new_traits_is_kept_with_the_join() -> None:
    """A device's presence says what it is now (its power state changes): the machine keeps it with its join,
    journaled like any state change; the same traits again change nothing."""
    from broker_server.core.rounds import Presence
    from broker_server.core.shell import Aggregator
    from protofl import topics
    from protofl.transport import InProcessBroker
    from protofl.wire import Status, encode_message

    agg = Aggregator(make_config("tinyproto", min_clients=2), "f", InProcessBroker().connect("s"))
    agg.start()
    agg.on_message(
        topics.up("f", "d1"),
        encode_message(Join("cnn", 10, traits=Traits("lte", ("a",), "battery", 90)), fed="f", sender="d1"),
    )
    now = Traits("lte", ("a",), "battery", 15)
    assert agg.machine.accepts(Presence("d1", True, traits=now))
    agg.on_presence(topics.presence("f", "d1"), encode_message(Status("online", traits=now), fed="f", sender="d1"))
    assert agg.clients["d1"].traits == now and agg.clients["d1"].n_samples == 10
    assert not agg.machine.accepts(Presence("d1", True, traits=now))
