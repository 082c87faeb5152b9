#!/usr/bin/env bash
# One device call (~150 s on an H100/H200) for issue 40's glm4moe slow path: GLM-4.5-Air's
# Q4_K_M keeps some ffn_down_exps (and the shared expert's down) as Q5_0 (1408-wide rows are no
# whole K block); those layers had no packed experts, so no CUDA graphs (tg128 33 t/s vs
# llama.cpp's 520 on an H100, 2026-12-06). Now packed widened to Q8_0 (`kernels.quant.widen`).
# 1. GPU tests of the fix (tests/kernels/test_widen.py's Q5_0 linear, tests/engine/
#    test_glm4moe_packed.py, tests/kernels/test_moe_packed.py's packed FFN with a Q5_0 down;
#    8 tests), while the GLM-4.5-Air-shaped random-weight Q4_K_M cut to 10 layers (GLM_LAYERS)
#    is made in the background (~70 s on 16 cores).
# 2. `localllm bench -p 512 -n 128 -r 2` on it (llama.cpp's figures on the same file are
#    recorded in tests/perf/results/hybrid.md: pp512 12,288, tg128 520.6 on an H100).
# Carry [".whl", ".refbuild/smollm2-tok.gguf"] and run from the repo root:
#   bash tests/perf/gpu_glm.sh        ($OUT: pytest.log, bench.md)
set -u
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
ln -sfn "$PWD" /tmp/site/localllm
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import llguidance, gguf" || { echo "carry .whl with llguidance and gguf"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/bench.md"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
date -u
GLM=/tmp/glm.gguf
python3 tests/perf/make_glm4moe.py --layers ${GLM_LAYERS:-10} -o $GLM \
  --tokenizer-from .refbuild/smollm2-tok.gguf >/tmp/make.log 2>&1 &
GEN=$!
timeout 60 python3 -m pytest -q -m gpu -k "Q5_0 or glm" -p no:cacheprovider \
  tests/kernels/test_widen.py tests/engine/test_glm4moe_packed.py tests/kernels/test_moe_packed.py \
  2>&1 | tee "$OUT/pytest.log" | grep -v "^\." | tail -15
wait $GEN || { tail -5 /tmp/make.log; exit 1; }
cat /tmp/make.log
date -u
timeout 120 python3 -m localllm.app.bench -m $GLM -p 512 -n 128 -r 2 --device cuda 2>&1 \
  | tee -a "$OUT/bench.md"
date -u
