#!/usr/bin/env bash
# One device call (~4 min on an H100/H200): image encode time and image-prompt time to first token,
# localllm (--device cuda) next to llama.cpp's llama-mtmd-cli (-ngl 99) on the same random-weight
# SmolVLM-500M-shaped pair (tests/perf/make_synthetic_vlm.py: SigLIP-base mmproj F16, SmolLM2-360M
# text Q8_0) and a generated 512x512 PNG, rounds alternating (tests/perf/bench_vision_vs_mtmd.py).
# Two tilings: preproc 1024 (2 x 2 tiles + the global view, 320 image tokens, as on the CPU run in
# tests/perf/results/vision.md) and preproc 2048 (SmolVLM's own: 4 x 4 + 1 = 17 tiles, 1088 tokens).
# $OUT collects vision_mtmd_<preproc>.md / .json and make.log.
# Prepare here first (git-excluded, carried):
#   bash tests/perf/h200_prepare.sh     # .whl (gguf, llguidance), .refbuild/smollm2-tok.gguf
#   python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 -d .whl pillow
#   .llb: llama.cpp's CUDA binaries with llama-mtmd-cli (tests/perf/gpu_build_llamacpp.sh made them)
# then run it with carry [".whl", ".refbuild/smollm2-tok.gguf", ".llb"]:
#   bash tests/perf/gpu_vision_mtmd.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/llb
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
ln -sfn "$PWD" /tmp/site/localllm
export PYTHONPATH=/tmp/site:$PWD
cat .llb/llb.part.* | xz -d | tar x -C /tmp/llb
export LD_LIBRARY_PATH=/tmp/llb/bin:${LD_LIBRARY_PATH:-}
if [ ! -x /tmp/llb/bin/llama-mtmd-cli ]; then  # (the .llb of 2026-12-06 06:45 held only llama-server)
  echo "the carried .llb has no llama-mtmd-cli: rebuild it with tests/perf/gpu_build_llamacpp.sh" >&2
  ls /tmp/llb/bin >&2
  exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
date -u
for pre in 1024 2048; do
  timeout 120 python3 tests/perf/make_synthetic_vlm.py -o /tmp/vlm$pre --preproc $pre \
    --tokenizer-from .refbuild/smollm2-tok.gguf >>"$OUT/make.log" 2>&1 || { tail "$OUT/make.log"; exit 1; }
done
date -u
for pre in 1024 2048; do
  timeout 150 python3 tests/perf/bench_vision_vs_mtmd.py --device cuda --threads 8 --rounds 5 \
    --text /tmp/vlm$pre/smolvlm-500m-text.gguf --mmproj /tmp/vlm$pre/smolvlm-500m-mmproj.gguf \
    --llama-bin /tmp/llb/bin --json "$OUT/vision_mtmd_$pre.json" 2>&1 | tee "$OUT/vision_mtmd_$pre.md" | tail -8
  date -u
done
