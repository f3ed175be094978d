#!/usr/bin/env bash
# Issue 48: `start --shards N` through the secured broker on the lent 16-core machine, against the broker's own rate
# to `mosquitto_sub` and a bare paho reader in the same run, within TOTAL_S (420 s) of device time.
#
# Here (this box), once, to fill the carried folder runs/device-carry/ (ignored by git; ~12 MB with the wheels):
#     bash bench/device_shards.sh --prepare
#     python -m pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#         --platform manylinux_2_28_x86_64 --no-deps -d runs/device-carry/wheels \
#         paho-mqtt==2.2.0 msgpack==1.2.4 msgspec==0.22.0 \
#         cryptography==48.0.0 cffi==2.0.0 pycparser==3.0 prometheus_client==0.26.0 numpy==2.4.6
# (the versions this box runs; numpy is installed only where the machine's Python has none; not typer, click or
# rich: the machine has its own, and a carried typer 0.29.2 needs pydantic, which it lacks).
# There (the device tool's command, from the repository root, carry ["runs/device-carry"]):
#     bash bench/device_shards.sh
#
# What it does there: installs the carried wheels into runs/device-carry/py (pip --no-index --target, nothing
# from a registry), writes this tree's package metadata beside them (the techniques are entry points:
# protofl.registry), puts wrappers for the carried mosquitto and mosquitto_sub (Debian 12's 2.0.11, with the
# shared libraries `ldd` lists except glibc's, on LD_LIBRARY_PATH for them alone) first on PATH, then for each N
# of SHARDS_LIST (1 2 4 8, then 0: one aggregator process), then of WINDOW_SHARDS (8 4) with the in-flight window
# WINDOW (200) asked by the server and its shards, runs
#     python -m bench.bench_aggregator --skip-inprocess --broker --broker-n N_DEVICES --broker-workloads tinyproto
#         --broker-repeats 1 --broker-shards N --out $OUT/shards-N.md
# (the real `start` path: its spawned secured Mosquitto, the journal with fsync and group commit, then the same
# publisher into mosquitto_sub, into the server's transport alone and into bare paho) under its own timeout
# (STEP_S, and never past TOTAL_S). Each step's lines land in $OUT as they come: device.log (this script's),
# shards-N.log (the bench's), shards-N.md/.json (its tables), SUMMARY.md (rebuilt after every step).
# A local run with small sizes (this box):  OUT=/tmp/ds N_DEVICES=300 STEP_S=120 TOTAL_S=400 bash bench/device_shards.sh
set -u
START=$(date +%s)
CARRY=${CARRY_DIR:-$PWD/runs/device-carry}
TOTAL=${TOTAL_S:-420}
STEP=${STEP_S:-100}
N_DEVICES=${N_DEVICES:-5000}
SHARDS_LIST=${SHARDS_LIST:-"1 2 4 8 0"}
WINDOW_SHARDS=${WINDOW_SHARDS:-"8 4"}  # then these again with the server's and shards' in-flight window WINDOW
WINDOW=${WINDOW:-200}                   # (PROTOFL_RECEIVE_MAXIMUM: broker_server/ops/capacity.py), while time is left
OUT=${OUT:-/tmp/device-shards-out}
PY=${PYTHON:-python3}
LIBS_SKIP='^(linux-vdso|libc\.so|libm\.so|libpthread|libdl\.so|librt\.so|libresolv|ld-linux)'

if [ "${1:-}" = "--prepare" ]; then  # here: the binaries and their libraries into $CARRY/mosquitto
  mkdir -p "$CARRY/mosquitto/bin" "$CARRY/mosquitto/lib" "$CARRY/wheels"
  for b in "$(command -v mosquitto || echo /usr/sbin/mosquitto)" "$(command -v mosquitto_sub)"; do
    cp -L "$b" "$CARRY/mosquitto/bin/"
    ldd "$b" | awk '$3 ~ /^\// {print $1, $3}' | while read -r name path; do
      echo "$name" | grep -Eq "$LIBS_SKIP" || cp -L "$path" "$CARRY/mosquitto/lib/$name"
    done
  done
  ls -la "$CARRY/mosquitto/bin" "$CARRY/mosquitto/lib"
  du -sh "$CARRY"
  echo "now the wheels into $CARRY/wheels (the pip download command at the top of this script)"
  exit 0
fi

mkdir -p "$OUT"
LOG="$OUT/device.log"
say() { echo "[$(date +%H:%M:%S) +$(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }
left() { echo $(( TOTAL - ( $(date +%s) - START ) )); }

# -- the Python side: carried wheels, no registry --------------------------------------------------------------
DEPS="$CARRY/py"
mkdir -p "$DEPS/bin"
if [ -d "$CARRY/wheels" ] && ls "$CARRY"/wheels/*.whl >/dev/null 2>&1; then
  wheels=()
  for w in "$CARRY"/wheels/*.whl; do
    case "$(basename "$w")" in
      numpy-*) $PY -c 'import numpy' 2>/dev/null && continue ;;  # the machine's own (torch's) stays
    esac
    wheels+=("$w")
  done
  say "installing ${#wheels[@]} carried wheel(s) into $DEPS"
  timeout 120 $PY -m pip install --quiet --no-index --no-deps --target "$DEPS" --upgrade "${wheels[@]}" >> "$LOG" 2>&1 \
    || say "pip install failed (exit $?): see $LOG"
else
  say "no wheels in $CARRY/wheels: using what the machine's Python has"
fi
# This tree's package metadata (its entry points name the techniques), without building or installing it.
$PY - "$DEPS" <<'EOF' >> "$LOG" 2>&1 || say "could not write the package metadata"
import sys, tomllib
from pathlib import Path
proj = tomllib.loads(Path("pyproject.toml").read_text())["project"]
info = Path(sys.argv[1]) / f"protofl_edge-{proj['version']}.dist-info"
info.mkdir(parents=True, exist_ok=True)
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {proj['name']}\nVersion: {proj['version']}\n")
groups = {"console_scripts": proj.get("scripts", {}), **proj.get("entry-points", {})}
text = "".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n" for g, eps in groups.items())
(info / "entry_points.txt").write_text(text)
print("wrote", info)
EOF
export PYTHONPATH="$PWD:$DEPS${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

# -- the broker and the C subscriber: carried binaries behind wrappers -----------------------------------------
if [ -x "$CARRY/mosquitto/bin/mosquitto" ]; then
  for b in mosquitto mosquitto_sub; do
    printf '#!/bin/sh\nLD_LIBRARY_PATH="%s/mosquitto/lib" exec "%s/mosquitto/bin/%s" "$@"\n' "$CARRY" "$CARRY" "$b" \
      > "$DEPS/bin/$b"
    chmod +x "$DEPS/bin/$b"
  done
  export PATH="$DEPS/bin:$PATH"
fi
say "mosquitto: $(command -v mosquitto) ($(mosquitto -h 2>&1 | head -1)); mosquitto_sub: $(command -v mosquitto_sub)"
say "$($PY -c 'import sys, numpy, paho.mqtt, msgpack; from protofl.registry import techniques
print("python", sys.version.split()[0], "numpy", numpy.__version__, "paho", paho.mqtt.__version__,
      "techniques", len(techniques()))' 2>&1 | tail -1)"
say "cores $(nproc), load $(cut -d' ' -f1-3 /proc/loadavg), open files $(ulimit -Hn) hard"
ulimit -n "$(ulimit -Hn)" 2>/dev/null

summary() {  # every result so far, as one table
  $PY - "$OUT" <<'EOF' > "$OUT/SUMMARY.md.tmp" 2>> "$LOG" && mv -f "$OUT/SUMMARY.md.tmp" "$OUT/SUMMARY.md"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print("| shards | window | uploads/s (start) | broker alone (mosquitto_sub) | ratio | server's transport alone | bare paho | "
      "start / bare paho | load before |")
print("|--:|--:|--:|--:|--:|--:|--:|--:|--|")
for f in sorted(out.glob("shards-*.json")):
    res = json.loads(f.read_text())
    load = res["machine"]["load_avg_before"]
    window = f.stem.split("-window")[1] if "-window" in f.stem else "broker's (20)"
    for runs in res.get("broker", {}).get("tinyproto", {}).values():
        for r in runs:
            print(f"| {r['shards'] or 'one process'} | {window} | {r['aggregator_uploads_per_s']:,.0f} | {r['broker_msgs_per_s']:,.0f} | "
                  f"{r['ratio']:.2f} | {r['transport_only_msgs_per_s']:,.0f} | {r['paho_only_msgs_per_s']:,.0f} | "
                  f"{r['aggregator_uploads_per_s'] / r['paho_only_msgs_per_s']:.2f} | {load} |")
EOF
}

steps=()
for s in $SHARDS_LIST; do steps+=("$s:"); done
for s in $WINDOW_SHARDS; do steps+=("$s:$WINDOW"); done
for step in "${steps[@]}"; do
  s=${step%%:*}
  w=${step#*:}
  name="$s${w:+-window$w}"
  b=$(left)
  if [ "$b" -lt 30 ]; then say "not started: --shards $s ${w:+window $w }(${b} s left)"; continue; fi
  t=$(( b < STEP ? b : STEP ))
  say "start --shards $s${w:+, in-flight window $w}, $N_DEVICES devices (timeout ${t} s)"
  # Its own process group (setsid), so that a step cut by its timeout takes its server, broker and publishers along.
  PROTOFL_RECEIVE_MAXIMUM="$w" setsid $PY -m bench.bench_aggregator --skip-inprocess --broker \
    --broker-n "$N_DEVICES" --broker-workloads tinyproto --broker-repeats 1 --broker-shards "$s" \
    --out "$OUT/shards-$name.md" > "$OUT/shards-$name.log" 2>&1 &
  pid=$!
  ( sleep "$t"; kill -INT -- "-$pid" 2>/dev/null; sleep 5; kill -KILL -- "-$pid" 2>/dev/null ) &
  dog=$!
  wait "$pid"
  rc=$?
  kill "$dog" 2>/dev/null
  kill -KILL -- "-$pid" 2>/dev/null  # what the step left running
  say "end $name: exit $rc; $(grep -E '^repeat' "$OUT/shards-$name.log" | sed 's/.*through the broker: //' | tail -1)"
  [ "$rc" -ne 0 ] && tail -5 "$OUT/shards-$name.log" | tee -a "$LOG"
  rm -rf "$PWD"/bench-agg-broker-*  # a cut run's state dirs (the bench removes its own when it ends)
  summary
done
say "done: $(wc -l < "$OUT/SUMMARY.md" 2>/dev/null || echo 0) summary lines"
