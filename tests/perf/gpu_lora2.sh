#!/usr/bin/env bash
# One device call (~4-5 min on an H100/H200), issue 36, LoRA decode overhead on CUDA:
#  1. the LoRA GPU tests: tests/kernels/test_lora_kernels.py (both kernel schemes against their torch
#     reference) and tests/lora/test_lora_gpu.py (logits, greedy and mixed batches with graphs,
#     kernels of either scheme against the torch ops);
#  2. decode on the Llama-3-8B-shaped Q4_K_M with 0, 1 and 4 rank-16 f16 adapters (`bench_lora.py
#     make --dtype f16`: convert_lora_to_gguf.py's default type), ours (`localllm bench`, default
#     kernels) next to llama.cpp's CUDA build with the very same files (bench_llamacpp_lora.py: a
#     small C program on its libllama, llama_adapter_lora_init + llama_set_adapters_lora);
#  3. the A/B of our kernel schemes, `bench_lora.py ab` (each case its own `localllm bench`
#     process, alternated): base, 1 and 4 adapters with the default (atomic split-K) kernels and
#     with the first ones (engine.lora.delta.SCHEME = "split").
# Prepare here first: `bash tests/perf/h200_prepare.sh` (.whl, .refbuild/smollm2-tok.gguf, the
# llama.cpp tree in .refbuild/llama.cpp for its headers) and a llama.cpp CUDA build holding
# libllama in .serve2 or .llb (gpu_build_llamacpp.sh); run from the repository root carrying
# [".whl", ".refbuild/smollm2-tok.gguf", ".serve2", ".refbuild/llama.cpp/include",
#  ".refbuild/llama.cpp/ggml/include"] (or ".llb" instead of ".serve2").
# $OUT collects pytest.log, compare.md/.err, ab.md/.err and summary.md (also printed last).
set -u
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
ln -sfn "$PWD" /tmp/site/localllm
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import llguidance, gguf" || { echo "carry .whl with llguidance and gguf"; exit 1; }
[ -f .refbuild/llama.cpp/include/llama.h ] || { echo "carry .refbuild/llama.cpp/include"; exit 1; }
LLB=.serve2
[ -d "$LLB" ] || LLB=.llb
[ -d "$LLB" ] || { echo "carry .serve2 or .llb (a llama.cpp CUDA build with libllama)"; exit 1; }
GPU=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)
VER=$(python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)")
echo "$GPU / $VER"
date -u
mkdir -p /tmp/llb && cat "$LLB"/llb.part.* | xz -d | tar x -C /tmp/llb
python3 tests/perf/make_synthetic.py --shape llama3-8b --quant Q4_K_M -o /tmp/q4km.gguf \
  --tokenizer-from .refbuild/smollm2-tok.gguf >/tmp/make.log 2>&1 &
GEN=$!
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_lora_kernels.py \
  tests/lora/test_lora_gpu.py 2>&1 | tee "$OUT/pytest.log" | grep -v "^\." | tail -25
wait $GEN || { tail -5 /tmp/make.log; exit 1; }
date -u
python3 tests/perf/bench_lora.py make --model /tmp/q4km.gguf --out /tmp/loras --rank 16 --count 4 \
  --dtype f16 >/dev/null
LD_LIBRARY_PATH=/tmp/llb/bin timeout 120 python3 tests/perf/bench_llamacpp_lora.py run \
  --model /tmp/q4km.gguf --dir /tmp/loras --llama-cpp .refbuild/llama.cpp --lib /tmp/llb/bin \
  --device cuda -n 128 --reps 3 --rounds 1 >"$OUT/compare.md" 2>"$OUT/compare.err"
tail -3 "$OUT/compare.err"
date -u
# what is left of ~280 s goes to the scheme A/B (partial rounds still print per-round rates)
LEFT=$((280 - $(date +%s) + T0))
[ "$LEFT" -lt 40 ] && LEFT=40
timeout "$LEFT" python3 tests/perf/bench_lora.py ab --model /tmp/q4km.gguf --dir /tmp/loras \
  --device cuda -n 128 --reps 3 --rounds "${ROUNDS:-2}" \
  --cases "base;1 adapter;1 adapter, split kernels;4 adapters;4 adapters, split kernels" \
  >"$OUT/ab.md" 2>"$OUT/ab.err"
date -u
{
  echo "## LoRA decode, $GPU, $VER, $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  echo "GPU tests: $(grep -E "passed|failed|error" "$OUT/pytest.log" | tail -1)"
  echo
  echo "Ours vs llama.cpp, same f16 GGUF LoRA files, rank 16, Llama-3-8B-shaped Q4_K_M, tg128:"
  echo
  cat "$OUT/compare.md"
  echo
  echo "Kernel schemes (atomic = default; split = the first kernels), tg128:"
  echo
  if [ -s "$OUT/ab.md" ]; then cat "$OUT/ab.md"; else echo "(ab cut short; its rounds:)"; grep round "$OUT/ab.err"; fi
} | tee "$OUT/summary.md"
