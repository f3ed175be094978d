#!/usr/bin/env bash
# Issue 56's full-data measurement (bench/predictor_routes.py, PREDICTOR.md "Full data") on a lent GPU machine,
# ending within TOTAL_S (470) seconds by construction:
#
#     bash bench/run_fulldata_device.sh          # from the repository root, $OUT set by the device tool
#
# Runs, side by side on the one GPU (each a process with --budget-s, so that none starts work it cannot finish
# before the deadline, and `timeout` as the hard stop):
#   A-cnn, B-cnn  the whole training set (60,000 images), cnn, A: 10 clients alpha 0.5, B: 20 clients alpha 0.1;
#                 seeds 0,1,2, one process each: public, ridge, fedavg-warm (to the plateau rule, cap PLATEAU_CAP
#                 60), refresh (R = ROUNDS, 30); one more process per setting: the variants refresh-t0,
#                 refresh-k004, refresh-erpa, refresh-proto over the seeds (--yield-late: they give way first)
#   A-resnet18    RefProtoFL's sizing: resnet18, 60,000 images, A, seed 0: public, ridge, refresh | fedavg-warm
#                 (two processes, --yield-late)
# Every per-round score is on all 10,000 test images (no --curve-test on a GPU).
# Fashion-MNIST from DATA_DIR (default runs/fashion-mnist: the four IDX .gz files of Debian's dataset-fashion-mnist,
# copied there and carried; /usr/share/datasets/fashion-mnist where the machine has it).
# Back in $OUT: fulldata.tar.gz (every JSON and process log under RES_DIR, refreshed every 15 s, so a cut run still
# returns what it finished), SUMMARY.md (--fulldata-summary: tables, plateau curves, verdicts), fulldata.png (the
# figure), device.log, gpu.csv.
# A dry run of the plumbing on a CPU:
#   OUT=/tmp/o RES_DIR=/tmp/r DEVICE=cpu TOTAL_S=240 ROUNDS=2 PLATEAU_CAP=2 SEEDS="0" WITH_R18=0 \
#   EXTRA_ARGS="--train-limit 600 --test-limit 200 --public-epochs 1 --threads 1" bash bench/run_fulldata_device.sh
set -u
START=$(date +%s)
TOTAL=${TOTAL_S:-470}
RESERVE=${RESERVE_S:-40}     # kept back for the last pack, the summary and the figure
OUT=${OUT:-/tmp/fulldata-out}
DATA=${DATA_DIR:-runs/fashion-mnist}
RES=${RES_DIR:-bench/results/predictor/fulldata-device}
ROUNDS=${ROUNDS:-30}
PLATEAU_CAP=${PLATEAU_CAP:-60}
SEEDS=${SEEDS:-0 1 2}
WITH_R18=${WITH_R18:-1}
DEVICE=${DEVICE:-cuda}
read -r -a EXTRA <<< "${EXTRA_ARGS:-}"  # appended to every run (argparse: the last wins); for dry runs only
mkdir -p "$OUT" "$RES"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
PY=${PYTHON:-python3}
LOG="$OUT/device.log"

left() { echo $(( TOTAL - RESERVE - ( $(date +%s) - START ) )); }
say() { echo "[$(date +%H:%M:%S) +$(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }

if ! ls "$DATA"/train-images-idx3-ubyte* >/dev/null 2>&1; then
  if ls /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte* >/dev/null 2>&1; then
    DATA=/usr/share/datasets/fashion-mnist
  else
    say "no Fashion-MNIST IDX files in $DATA (set DATA_DIR)"; exit 2
  fi
fi
say "data $DATA: $(ls "$DATA" | tr '\n' ' ')"
say "$(nvidia-smi -L 2>&1 | head -1)"
say "$($PY -c 'import torch, numpy; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "numpy", numpy.__version__)' 2>&1)"

pack() {
  tar czf "$OUT/fulldata.tar.gz.tmp" --exclude=cache --exclude='*.tmp' -C "$(dirname "$RES")" "$(basename "$RES")" \
    2>/dev/null && mv -f "$OUT/fulldata.tar.gz.tmp" "$OUT/fulldata.tar.gz"
}
( while sleep 15; do pack; done ) & PACKER=$!
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -l 10 > "$OUT/gpu.csv" 2>/dev/null & SMI=$!

run() {  # run NAME ARGS...: one process; its log is $RES/NAME.log
  local name=$1; shift
  local b; b=$(left)
  if [ "$b" -lt 40 ]; then say "not started: $name (${b} s left)"; return 0; fi
  say "start $name (--budget-s $b): $*"
  timeout --signal=INT --kill-after=10 $((b + 5)) \
    $PY -m bench.predictor_routes --budget-s "$b" --device "$DEVICE" --data-dir "$DATA" "$@" "${EXTRA[@]}" \
    > "$RES/$name.log" 2>&1
  say "end $name: exit $?; $(grep -c ' -> ' "$RES/$name.log") results; $(grep -cE 'SKIPPED|STOPPED' "$RES/$name.log") skipped/stopped"
}

COMMON=(--arch cnn --train-limit 60000 --rounds "$ROUNDS" --plateau-cap "$PLATEAU_CAP" --test-every 1 --progress 10)
A=(--clients 10 --alpha 0.5 --out "$RES/A-cnn")
B=(--clients 20 --alpha 0.1 --out "$RES/B-cnn")
PIDS=()
for s in $SEEDS; do
  run "a-core-s$s" "${COMMON[@]}" "${A[@]}" --seeds "$s" --routes public,ridge,fedavg-warm,refresh & PIDS+=($!)
  run "b-core-s$s" "${COMMON[@]}" "${B[@]}" --seeds "$s" --routes public,ridge,fedavg-warm,refresh & PIDS+=($!)
done
VARIANTS=refresh-frozen-head,refresh-t0,refresh-k004,refresh-erpa,refresh-proto
SEEDLIST=$(echo "$SEEDS" | tr ' ' ',')
run a-variants "${COMMON[@]}" "${A[@]}" --seeds "$SEEDLIST" --routes "$VARIANTS" --yield-late & PIDS+=($!)
run b-variants "${COMMON[@]}" "${B[@]}" --seeds "$SEEDLIST" --routes "$VARIANTS" --yield-late & PIDS+=($!)
if [ "$WITH_R18" = 1 ]; then
  R18=(--arch resnet18 --train-limit 60000 --clients 10 --alpha 0.5 --rounds "$ROUNDS" --plateau-cap "$PLATEAU_CAP"
       --test-every 1 --progress 5 --seeds 0 --out "$RES/A-resnet18")
  run r18-refresh "${R18[@]}" --routes public,ridge,refresh --yield-late & PIDS+=($!)
  run r18-fedavg-warm "${R18[@]}" --routes fedavg-warm --yield-late & PIDS+=($!)
fi
wait "${PIDS[@]}"

kill "$PACKER" "$SMI" 2>/dev/null
pack
dirs=("$RES/A-cnn" "$RES/B-cnn")
[ "$WITH_R18" = 1 ] && dirs+=("$RES/A-resnet18")
$PY -m bench.predictor_routes --fulldata-summary "${dirs[@]}" --figure "$OUT/fulldata.png" > "$OUT/SUMMARY.md" 2>&1
cat "$OUT/SUMMARY.md"
say "done in $(( $(date +%s) - START )) s; $OUT: $(ls "$OUT" | tr '\n' ' ')"
