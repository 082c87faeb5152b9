#!/usr/bin/env bash
# One device call (~5 min on an H100/H200): the LoRA GPU tests (tests/lora/test_lora_gpu.py and the
# shrink/expand kernels against their torch reference, tests/kernels/test_lora_kernels.py), then
# the decode overhead of 1 and 4 rank-16 adapters on the Llama-3-8B-shaped Q4_K_M (`localllm
# bench` runs alternated round by round: base, 1 adapter, 4, 4 at scale 0, and 1 adapter through
# the torch ops instead of the kernels), and llama.cpp's
# llama-server with the same GGUF LoRAs (its build from .llb, gpu_build_llamacpp.sh).
# Prepare here first: `bash tests/perf/h200_prepare.sh` (.whl with gguf and llguidance,
# .refbuild/smollm2-tok.gguf); carry [".whl", ".refbuild/smollm2-tok.gguf", ".llb"].
# $OUT collects pytest.log, ab.md, llamacpp.md and llama-server-*.log.
set -u
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
ln -sfn "$PWD" /tmp/site/localllm
export PYTHONPATH=/tmp/site:$PWD
# the engine imports llguidance (structured output): without it no test is even collected
python3 -c "import llguidance, gguf" || { echo "carry .whl with llguidance and gguf"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
date -u
python3 tests/perf/make_synthetic.py --shape llama3-8b --quant Q4_K_M -o /tmp/q4km.gguf \
  --tokenizer-from .refbuild/smollm2-tok.gguf >/tmp/make.log 2>&1 &
GEN=$!
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/lora/test_lora_gpu.py \
  tests/kernels/test_lora_kernels.py 2>&1 | tee "$OUT/pytest.log" | grep -v "^\." | tail -25
wait $GEN || { tail -5 /tmp/make.log; exit 1; }
date -u
python3 tests/perf/bench_lora.py make --model /tmp/q4km.gguf --out /tmp/loras --rank 16 --count 4
timeout 230 python3 tests/perf/bench_lora.py ab --model /tmp/q4km.gguf --dir /tmp/loras \
  --device cuda -n 128 --reps 3 --rounds 2 2>&1 | tee "$OUT/ab.md"
if [ -d .llb ]; then
  mkdir -p /tmp/llb && cat .llb/llb.part.* | xz -d | tar x -C /tmp/llb
  LD_LIBRARY_PATH=/tmp/llb/bin timeout 120 python3 tests/perf/bench_lora.py llamacpp \
    --server /tmp/llb/bin/llama-server --model /tmp/q4km.gguf --dir /tmp/loras -n 128 --reps 3 \
    --log-dir "$OUT" 2>&1 | tee "$OUT/llamacpp.md"
  for f in "$OUT"/llama-server-*.log; do  # what the server said about a failed case
    grep -iE "error|exception|failed|lora" "$f" | tail -5
  done
fi
date -u
