#!/usr/bin/env bash
# Issue 41's global-predictor routes (bench/predictor_routes.py) on a lent GPU machine, ending within 480 s:
#
#     bash bench/run_predictor_device.sh          # from the repository root, $OUT set by the device tool
#
# Runs, side by side on the one GPU (each a process of its own; each with --budget-s so that none starts work
# it cannot finish before the deadline, and `timeout` as the hard stop):
#   A-resnet18  RefProtoFL's sizing: resnet18, the whole training set, 10 clients, alpha 0.5, R18_ROUNDS (20)
#               rounds, seed 0; four processes: fedavg | topk-ef | local | the shared-backbone routes + distil;
#               topk-ef and local give way (--yield-late: they stop once their pace says they cannot finish,
#               leaving the GPU to FedAvg and the shared-backbone routes)
#   A-cnn       setting A: cnn, train-limit 6000, 10 clients, alpha 0.5, CNN_ROUNDS (50) rounds, seeds 0-4
#               (one process per seed)
#   B-cnn       then setting B: 20 clients, alpha 0.1, the same otherwise (WITH_B=0 leaves it out)
# Fashion-MNIST from DATA_DIR (default runs/fashion-mnist: the four IDX .gz files of Debian's
# dataset-fashion-mnist, copied there and carried; /usr/share/datasets/fashion-mnist where the machine has it).
# What comes back in $OUT (the tool returns at most 8 files): predictor.tar.gz (every result JSON and process log
# under bench/results/predictor, refreshed every 15 s, so a cut run still returns what it finished),
# SUMMARY.md (the tables and the rule's verdicts), device.log (this script's lines), gpu.csv (utilisation).
# A dry run of the plumbing on a CPU (every run made a tiny cnn one, results in a scratch folder; on a busy 2-core box
# the nine processes mostly show the budget skipping and the hard stop at work):
#   OUT=/tmp/o RES_DIR=/tmp/r DEVICE=cpu TOTAL_S=200 R18_ROUNDS=1 CNN_ROUNDS=1 WITH_B=0 \
#   EXTRA_ARGS="--arch cnn --train-limit 900 --test-limit 200 --public-epochs 1 --threads 1" bash bench/run_predictor_device.sh
set -u
START=$(date +%s)
TOTAL=${TOTAL_S:-480}        # the whole script ends within this many seconds
RESERVE=${RESERVE_S:-35}     # kept back for the last pack and the summary
OUT=${OUT:-/tmp/predictor-out}
DATA=${DATA_DIR:-runs/fashion-mnist}
RES=${RES_DIR:-bench/results/predictor}
R18_ROUNDS=${R18_ROUNDS:-20}
CNN_ROUNDS=${CNN_ROUNDS:-50}
WITH_B=${WITH_B:-1}
DEVICE=${DEVICE:-cuda}
read -r -a EXTRA <<< "${EXTRA_ARGS:-}"  # appended to every run (argparse: the last wins); for dry runs only
mkdir -p "$OUT" "$RES"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2
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
say "$($PY -c 'import msgpack; print("msgpack", msgpack.version)' 2>&1 | tail -1) (without it the bench uses its own copy of the prototype math)"

pack() {  # every result so far as one file
  tar czf "$OUT/predictor.tar.gz.tmp" --exclude=cache --exclude='*.tmp' -C "$(dirname "$RES")" "$(basename "$RES")" \
    2>/dev/null && mv -f "$OUT/predictor.tar.gz.tmp" "$OUT/predictor.tar.gz"
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
  local rc=$?
  say "end $name: exit $rc; $(grep -c ' -> ' "$RES/$name.log") results; $(grep -E 'SKIPPED|STOPPED' "$RES/$name.log" | wc -l) skipped/stopped"
}

R18=(--arch resnet18 --train-limit 60000 --clients 10 --alpha 0.5 --rounds "$R18_ROUNDS" --seeds 0 --test-every 1
     --out "$RES/A-resnet18")
CNN_A=(--arch cnn --train-limit 6000 --clients 10 --alpha 0.5 --rounds "$CNN_ROUNDS" --test-every 1 --out "$RES/A-cnn")
CNN_B=(--arch cnn --train-limit 6000 --clients 20 --alpha 0.1 --rounds "$CNN_ROUNDS" --test-every 1 --out "$RES/B-cnn")

PIDS=()
run r18-fedavg "${R18[@]}" --routes fedavg & PIDS+=($!)
run r18-topk "${R18[@]}" --routes topk-ef --yield-late & PIDS+=($!)
run r18-local "${R18[@]}" --routes local --yield-late & PIDS+=($!)
run r18-shared "${R18[@]}" --routes public,proto,ridge,head,head-ncm,head-ridge,adapter-head,distil & PIDS+=($!)
(
  for s in 0 1 2 3 4; do run "a-cnn-s$s" "${CNN_A[@]}" --seeds "$s" & done; wait
  if [ "$WITH_B" = 1 ]; then
    for s in 0 1 2 3 4; do run "b-cnn-s$s" "${CNN_B[@]}" --seeds "$s" & done; wait
  fi
) & PIDS+=($!)
wait "${PIDS[@]}"

kill "$PACKER" "$SMI" 2>/dev/null
pack
dirs=("$RES/A-cnn" "$RES/A-resnet18")
[ "$WITH_B" = 1 ] && dirs+=("$RES/B-cnn")
$PY -m bench.predictor_routes --summary "${dirs[@]}" > "$OUT/SUMMARY.md" 2>&1
cat "$OUT/SUMMARY.md"
say "done in $(( $(date +%s) - START )) s; $OUT: $(ls "$OUT" | tr '\n' ' ')"
