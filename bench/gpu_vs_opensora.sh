#!/usr/bin/env bash
# jaxsora's train step against Open-Sora 1.2's own (PyTorch, as scripts/train.py runs it) on one GPU, in one device
# call: STDiT3-XL/2 at stage 1's 240p × 51 frames (15×30×53 latents), bf16, the real caption (300 × 4096, 40–150
# valid tokens, the same on both sides). Every variant is a process of its own (bench/step.py): the jaxsora ones
# compile side by side first (the slow part, on the CPU cores; no step runs meanwhile), then each process takes its
# turn on the GPU alone — state, warm-up, timed steps, exit — so that no two hold the GPU's memory at once.
#
# The GPU session's one command (prepare on the CPU machine first: `bash bench/gpu_vs_opensora_prep.sh`):
#   run(command="bash bench/gpu_vs_opensora.sh", carry=[".whl", ".gpu-bench"], timeout_s=540)
# On CPU, the plumbing at a tiny shape (both sides; what tests/tools/test_gpu_vs_opensora.py runs):
#   SHAPE="--model tiny --latent 4x16x16" VARIANTS=$'jax-b2||--batch 2 --remat auto\nos-b2||--batch 2 --reference \
#     /tmp/refenv/bin/python --reference-mode train --reference-only' PY=.venv/bin/python WHEELS=none \
#     bash bench/gpu_vs_opensora.sh
#
# Default variants ("name|environment|flags", one per line; VARIANTS replaces them, EXTRA adds flags to each):
#   jax-b4      jaxsora, batch 4, model.remat="auto" (the remat the plan picks in this GPU's memory)
#   os-b4       Open-Sora, batch 4: bf16 weights + fp32 masters, AdamW, EMA, clipping, gradient checkpointing of
#               every block, flash-attn if the image has it, else torch's SDPA (no apex fused LayerNorm there)
#   jax-b20     jaxsora, batch 20 (stage 1's per-GPU batch for 240p × 51), remat auto
#   os-b20      Open-Sora, batch 20
# Device time, estimated (not measured: no GPU in the session that wrote this): an XL/2 step compiles in ~3 min
# beside 1-2 other compiles on the H200 machine (bench/gpu_step.sh); remat auto compiles its four rungs at once
# (bench/step.py --remat-parallel), then, where none of none/save_matmuls/save_qkv_proj fits but full does, up to
# three partial ones at once: jax-b20 about two compile times, jax-b4 one. Then four turns of ~30-60 s (state,
# warm-up, 8 steps; Open-Sora builds its model in its turn). About 8 min: run it with timeout_s=540, LIMIT=480.
# EXTRA="--scan" (blocks scanned: ~2/3 of the compile time, the step ~5% slower) if the first call runs out.
# More in the same form, when the device time allows:
#   jaxsora with full remat:         jax-b4-full||--batch 4 --remat full   (the README's 0.725 s of 2026-11-27)
#   the largest batch of each side:  jax-max||--batch max --remat auto
#                                    os-max||--reference python3 --reference-mode train --reference-only --reference-batch max
#   XLA:GPU options, one at a time:  jax-b4-lhs|JAXSORA_GPU_XLA=lhs|--batch 4 --remat auto   (no-triton-gemm,
#                                    cudnn-layer-norm, no-command-buffer, command-buffer-loops, cublaslt)
#   a stage 2/3 bucket:              SHAPE="--model STDiT3-XL/2 --latent 15x60x106 --dtype bfloat16" (480p × 51)
#
# Writes <variant>.txt (progress and table) and <variant>.json under $OUT, and prints the summary last: per variant
# the batch, remat, step time, tokens/s, model TFLOP/s, MFU (bf16 dense peak 989 TFLOP/s on H100 SXM / H200, the
# NVIDIA datasheets, jaxsora/train/plan/mfu.py), peak memory, and jaxsora's time over Open-Sora's at the same batch
# (time per sample where the batches differ).
set -u
OUT=${OUT:-/tmp/gpu_vs_opensora}
mkdir -p "$OUT"
PY=${PY:-python3}
REFPY=${REFPY:-$PY}
WHEELS=${WHEELS:-.whl}  # "none": use the interpreters' own packages (the CPU test)
if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
# the Open-Sora sources and the harness that imports them, carried in .gpu-bench/ (bench/gpu_vs_opensora_prep.sh)
[ -d .gpu-bench/refharness ] && export REFHARNESS=$PWD/.gpu-bench/refharness
[ -d .gpu-bench/opensora-ref ] && export OPENSORA_REF_DIR=$PWD/.gpu-bench/opensora-ref
SHAPE=${SHAPE:-"--model STDiT3-XL/2 --latent 15x30x53 --dtype bfloat16"}
STEPS=${STEPS:-8}
LIMIT=${LIMIT:-480}   # seconds per variant, compile and its wait for the others included
SYNC=$(mktemp -d)  # the turn lock and the ready/done markers (not under $OUT: only the results come back)
# one process at a time runs on the GPU (its turn) and may plan into most of its memory (remat auto: 0.9 of this
# fraction); no preallocation, so the processes waiting for their turn hold only what their compiles left cached
export BENCH_STEP_LOCK="$SYNC/device.lock" XLA_PYTHON_CLIENT_PREALLOCATE=false \
  XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.75}
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
"$REFPY" -c "import torch; print('torch', torch.__version__, torch.cuda.is_available() and torch.cuda.get_device_name())"
REF="--reference $REFPY --reference-mode train"
VARIANTS=${VARIANTS:-"jax-b4||--batch 4 --remat auto
os-b4||--batch 4 $REF --reference-only
jax-b20||--batch 20 --remat auto
os-b20||--batch 20 $REF --reference-only"}
EXTRA=${EXTRA:-}
mapfile -t rows <<<"$VARIANTS"
export BENCH_STEP_PEERS=${#rows[@]}
for row in "${rows[@]}"; do
  IFS='|' read -r v venv vflags <<<"$row"
  # shellcheck disable=SC2086
  (export BENCH_STEP_NAME=$v $venv; timeout "$LIMIT" "$PY" bench/step.py $SHAPE $vflags $EXTRA --steps "$STEPS" \
     --norm-guard 2 --json "$OUT/$v.json" >"$OUT/$v.txt" 2>&1; touch "$SYNC/.done.$v") &
done
wait
for row in "${rows[@]}"; do
  IFS='|' read -r v venv vflags <<<"$row"
  echo "== $v (${venv:-} ${vflags:-default})"
  grep -E "remat auto|largest batch|compiled in|initialized in|Error|error:|Traceback" "$OUT/$v.txt" | tail -8
  [ -s "$OUT/$v.json" ] || { echo "   (no result: the end of $v.txt)"; tail -5 "$OUT/$v.txt"; }
done
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=memory.used,clocks.sm,temperature.gpu --format=csv,noheader
"$PY" bench/gpu_summary.py "$OUT" "${rows[@]}"
exit 0
