#!/usr/bin/env bash
# One device call's worth of train-step measurements on a lent GPU (run from the repository root there):
# the STDiT3-XL/2 step at 240p × 51 frames (15×30×53 latents), batch 4, bf16, remat full — stage 1's
# shape — three ways: blocks scanned, blocks unrolled (the stage configs' default), and scanned with
# the XLA attention instead of cuDNN. The three processes compile side by side (the slow part, on the
# CPU cores) and take turns on the GPU to time their steps (bench/step.py's BENCH_STEP_LOCK).
#
#   run(command="bash bench/gpu_step.sh", carry=[".whl"], timeout_s=500)   # .whl: ../shared/tools/device-wheels.sh
#   SHAPE="--model tiny --latent 4x16x16 --batch 2" LIMIT=300 bash bench/gpu_step.sh    # the plumbing, on CPU
#
# Writes <variant>.txt (progress and table) and <variant>.json per variant under $OUT, prints a summary.
# VARIANTS="name|ENV=value|flags" lines replace the three; EXTRA="--profile --profile-top 30" adds flags to
# each; BENCH_PROFILE_KEEP=$OUT keeps each profiled variant's raw trace.
#
# Read on an H200 (jax 0.11.2, 2026-11-26), XL/2 240p×51 batch 4 bf16 remat full, attention "auto" (cuDNN):
#   unrolled  0.746–0.750 s/step, 217 model TFLOP/s, MFU 22%, 25.2 GiB; compile 177–196 s beside 1–2 others
#             0.725 s, 224 TFLOP/s, MFU 22.6% (2026-11-27: cuDNN's odd lengths padded at the layers' inputs)
#             0.722 s (2026-11-27, after the Linear layers' weight-gradient form of aecd4d4, made for XLA:CPU) against
#             0.728 s with autodiff's (VARIANTS=$'unrolled||\nautodiff||--dense-backward autodiff'): the same
#   scan      0.767 s, MFU 21%, 27.8 GiB; compile 114 s beside 2 others
#   scan with the XLA attention  0.872 s, MFU 19%, 29.4 GiB
#   the fresh state: 65–79 s to compile and run with XLA's inline threefry, 11 s with jax's threefry kernel
#   (now the default: jaxsora.train.step.state.use_threefry_kernel_on_gpu), the step's time unchanged
set -u
OUT=${OUT:-/tmp/gpu_step}
mkdir -p "$OUT"
PY=${PY:-python3}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
SHAPE=${SHAPE:-"--model STDiT3-XL/2 --latent 15x30x53 --batch 4 --dtype bfloat16 --remat full"}
LIMIT=${LIMIT:-420}   # seconds per variant, compile included
SYNC=$(mktemp -d)  # the turn lock and the ready/done markers (not under $OUT: only the results come back)
export BENCH_STEP_LOCK="$SYNC/device.lock" XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.3}
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
# Variants as "name|environment|flags", one per line; VARIANTS replaces them, EXTRA adds flags to all.
VARIANTS=${VARIANTS:-"scan||--scan
unrolled||
scan-xla-attention||--scan --attention xla"}
EXTRA=${EXTRA:-}
mapfile -t rows <<<"$VARIANTS"
export BENCH_STEP_PEERS=${#rows[@]}
for row in "${rows[@]}"; do
  IFS='|' read -r v venv vflags <<<"$row"
  # shellcheck disable=SC2086
  (export BENCH_STEP_NAME=$v $venv; timeout "$LIMIT" "$PY" bench/step.py $SHAPE $vflags $EXTRA --steps 5 \
     --norm-guard 2 --json "$OUT/$v.json" >"$OUT/$v.txt" 2>&1; touch "$SYNC/.done.$v") &
done
wait
for row in "${rows[@]}"; do
  IFS='|' read -r v venv vflags <<<"$row"
  echo "== $v (${venv:-} ${vflags:-default})"
  grep -E "lowered in|compiled in|initialized in|step [0-9]+/|Error|error:|^\[.*\]   " "$OUT/$v.txt" | tail -40
  grep -E "^custom " "$OUT/$v.txt" || echo "   (no result: see $v.txt)"
  "$PY" -c "import json, sys; r = json.load(open(sys.argv[1]))[0]['rows'][0]; print('   loss', r['loss'])" \
    "$OUT/$v.json" 2>/dev/null
done
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=memory.used,clocks.sm,temperature.gpu --format=csv,noheader
exit 0
