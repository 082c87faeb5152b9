#!/usr/bin/env bash
# One device call (~2 min on an H100/H200): the Gemma 3 and LLaVA-1.5/1.6 vision GPU tests
# (towers on the GPU, Gemma 3's image spans through the CUDA prompt path, greedy against transformers'
# record; the span paths in f16/bf16; the flash prefill kernel with and without spans), then
# bench_vision_gemma3.py: a Gemma-3-4B-shaped tower's encode time and one layer's prompt
# attention with an image span (flash prefill with spans, without, and the dense torch path).
# $OUT collects pytest.log and vision_gemma3.md.
# Prepare here first (git-excluded, carried):
#   bash tests/perf/h200_prepare.sh      # .whl: gguf, llguidance (the image lacks them)
#   python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 -d .whl pillow
# then run it with carry [".whl"]:  bash tests/perf/gpu_vision_gemma3.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
ln -sfn "$PWD" /tmp/site/localllm
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
date -u
timeout "${TEST_T:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/media/test_vision_gpu_gemma3_llava.py tests/kernels/test_flash_prefill_spans.py \
  tests/kernels/test_flash_prefill.py 2>&1 | tee "$OUT/pytest.log" | tail -15
date -u
for prompt in 1024 4096; do
  timeout 120 python3 tests/perf/bench_vision_gemma3.py --device cuda --prompt $prompt -r 5 2>&1 \
    | tee -a "$OUT/vision_gemma3.md"
done
date -u
