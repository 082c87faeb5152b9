#!/usr/bin/env bash
# One device call (~4 min on an H100/H200): qwen3next's GPU tests (the triton decode steps of the
# delta rule and the conv against their references, the converted fixture on CUDA against
# transformers' goldens), then `localllm bench` pp512/tg128 on a Qwen3-Next-80B-A3B-shaped random
# Q4_K_M of LAYERS (default 12: 9 DeltaNet + 3 attention, ~11 GiB) layers, and llama.cpp's
# llama-bench on the same file when its build is carried (.llb from gpu_build_llamacpp.sh).
# Prepare here: `bash tests/perf/h200_prepare.sh` (.whl, .refbuild/smollm2-tok.gguf); carry
# [".whl", ".refbuild/smollm2-tok.gguf"] (+ ".llb"). $OUT collects pytest.log and bench.md.
set -u
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
ln -sfn "$PWD" /tmp/site/localllm
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/bench.md"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
date -u
MODEL=/tmp/q3next.gguf
python3 tests/perf/make_qwen3next.py --layers "${LAYERS:-12}" -o $MODEL \
  --tokenizer-from .refbuild/smollm2-tok.gguf >/tmp/make.log 2>&1 &
GEN=$!
timeout "${TEST_T:-150}" python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/kernels/test_recurrent_triton.py tests/engine/test_qwen3next_gpu.py 2>&1 \
  | tee "$OUT/pytest.log" | grep -v "^\." | tail -15
date -u
wait $GEN || { tail -5 /tmp/make.log; exit 1; }
tail -1 /tmp/make.log | tee -a "$OUT/bench.md"
timeout 150 python3 -m localllm.app.bench -m $MODEL -p 512 -n 128 -r 3 --device cuda 2>&1 \
  | tee -a "$OUT/bench.md" | grep -E "pp512|tg128|Error"
if [ -d .llb ]; then
  mkdir -p /tmp/llb && cat .llb/llb.part.* | xz -d | tar x -C /tmp/llb
  LD_LIBRARY_PATH=/tmp/llb/bin timeout 120 /tmp/llb/bin/llama-bench -m $MODEL -p 512 -n 128 \
    -r 3 -ngl 99 2>&1 | tee -a "$OUT/bench.md" | grep -E "pp512|tg128|error"
fi
date -u
