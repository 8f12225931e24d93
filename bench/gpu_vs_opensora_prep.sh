#!/usr/bin/env bash
# Prepare, on the CPU machine, what bench/gpu_vs_opensora.sh needs on the GPU machine, which has no network:
#   .whl/        wheels the GPU image lacks: ml-collections (configs/), and for Open-Sora's STDiT3 the versions its
#                requirements pin: rotary-embedding-torch 0.5.3, beartype 0.23.1, timm 0.9.16
#   .gpu-bench/  the Open-Sora 1.2 source files the harness imports (tag v1.2.0, ../shared/refharness/extract.sh)
#                and the harness itself (ref_stdit3.py)
# Both are ignored by git (.gitignore) and travel as the device call's `carry`:
#   bash bench/gpu_vs_opensora_prep.sh [MIRROR_GITDIR]    # a bare mirror of github:hpcaitech/Open-Sora
#   run(command="bash bench/gpu_vs_opensora.sh", carry=[".whl", ".gpu-bench"], timeout_s=540)
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
MIRROR=${1:-/work/.mirror/hpcaitech+Open-Sora/repo}
HARNESS=${REFHARNESS:-$top/../shared/refharness}
COMMIT=17cce908b22283acc3c946816c81f46dd442a453  # tag v1.2.0 (../shared/refharness/README.md)
PY=${PYTHON:-python3}
mkdir -p .whl
for p in ml-collections rotary-embedding-torch==0.5.3 beartype==0.23.1 timm==0.9.16; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl "$p"
done
scratch=$(mktemp -d)  # extract.sh refuses a folder inside a git work tree
bash "$HARNESS/extract.sh" "$MIRROR" "$COMMIT" "$scratch/opensora-ref" >/dev/null
rm -rf .gpu-bench
mkdir -p .gpu-bench/refharness
cp -r "$scratch/opensora-ref" .gpu-bench/opensora-ref
cp "$HARNESS/ref_stdit3.py" .gpu-bench/refharness/
rm -rf "$scratch"
du -sh .whl .gpu-bench
echo 'then: run(command="bash bench/gpu_vs_opensora.sh", carry=[".whl", ".gpu-bench"], timeout_s=540)'
