#!/usr/bin/env bash
# One device call (~4-5 min on an H100/H200), issue 36, LoRA decode overhead on CUDA:
#  1. the LoRA GPU tests: tests/kernels/test_lora_kernels.py (each kernel scheme against the torch
#     reference) and tests/lora/test_lora_gpu.py (logits, greedy and mixed batches with graphs,
#     each scheme's kernels against the torch ops); the one-launch "fused" scheme's cases (a grid
#     barrier: a hang would cost the other results) in a second pytest with its own timeout;
#  2. tests/perf/bench_lora_kernels.py: one step's 128 LoRA calls (8B shapes) per scheme in a CUDA
#     graph, microseconds per step, 1 and 4 adapters, 1 and 4 rows (the deltas' own GPU time);
#  3. decode on the Llama-3-8B-shaped Q4_K_M with 0, 1 and 4 rank-16 f16 adapters (`bench_lora.py
#     make --dtype f16`: convert_lora_to_gguf.py's default type), ours (`localllm bench`, default
#     kernels) next to llama.cpp's CUDA build with the very same files (bench_llamacpp_lora.py: a
#     small C program on its libllama, llama_adapter_lora_init + llama_set_adapters_lora);
#  4. the A/B of our kernel schemes, `bench_lora.py ab` (each case its own `localllm bench`
#     process, alternated; one table per round, rounds while time is left): base, 1 and 4
#     adapters with the default two-launch kernels (atomic split-K) and the one-launch kernel
#     (engine.lora.delta.SCHEME = "fused"); the first kernels' A/B is recorded in lora.md.
# Prepare here first: `bash tests/perf/h200_prepare.sh` (.whl, .refbuild/smollm2-tok.gguf, the
# llama.cpp tree in .refbuild/llama.cpp for its headers) and a llama.cpp CUDA build holding
# libllama in .serve2 or .llb (gpu_build_llamacpp.sh); run from the repository root carrying
# [".whl", ".refbuild/smollm2-tok.gguf", ".serve2", ".refbuild/llama.cpp/include",
#  ".refbuild/llama.cpp/ggml/include"] (or ".llb" instead of ".serve2").
# $OUT collects pytest.log, pytest_fused.log, kernels.md/.err, compare.md/.err, ab.md/.err and
# summary.md (printed last). ROUNDS (default 3) caps the A/B rounds; they stop when time runs short.
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
TESTS="tests/kernels/test_lora_kernels.py tests/lora/test_lora_gpu.py"
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -k "not fused" $TESTS 2>&1 \
  | tee "$OUT/pytest.log" | grep -v "^\." | tail -20
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider -k fused $TESTS 2>&1 \
  | tee "$OUT/pytest_fused.log" | grep -v "^\." | tail -12
[ "${PIPESTATUS[0]}" = 124 ] && echo "fused tests TIMED OUT (grid barrier hang?)" >>"$OUT/pytest_fused.log"
FUSED_OK=0
grep -qE "[0-9]+ passed" "$OUT/pytest_fused.log" && FUSED_OK=1
grep -qE "[0-9]+ (failed|errors?)\b|TIMED" "$OUT/pytest_fused.log" && FUSED_OK=0
# the deltas alone: one step's 128 LoRA calls per scheme in a CUDA graph (no GEMVs between)
KS=atomic,torch
[ $FUSED_OK = 1 ] && KS=atomic,fused,torch
timeout 60 python3 tests/perf/bench_lora_kernels.py --schemes $KS >"$OUT/kernels.md" 2>"$OUT/kernels.err"
cat "$OUT/kernels.md"; tail -3 "$OUT/kernels.err"
wait $GEN || { tail -5 /tmp/make.log; exit 1; }
date -u
python3 tests/perf/bench_lora.py make --model /tmp/q4km.gguf --out /tmp/loras --rank 16 --count 4 \
  --dtype f16 >/dev/null
LD_LIBRARY_PATH=/tmp/llb/bin timeout 120 python3 tests/perf/bench_llamacpp_lora.py run \
  --model /tmp/q4km.gguf --dir /tmp/loras --llama-cpp .refbuild/llama.cpp --lib /tmp/llb/bin \
  --device cuda -n 128 --reps 3 --rounds 1 >"$OUT/compare.md" 2>"$OUT/compare.err"
tail -3 "$OUT/compare.err"
date -u
# the scheme A/B, a round at a time while ~285 s are not spent (a cut round keeps its lines in ab.err)
CASES="base;1 adapter;4 adapters"
# the one-launch kernel only where its tests passed (a hang would cut whole rounds)
[ $FUSED_OK = 1 ] && CASES="$CASES;1 adapter, fused kernel;4 adapters, fused kernel"
: >"$OUT/ab.md"
for round in $(seq "${ROUNDS:-3}"); do
  LEFT=$((285 - $(date +%s) + T0))
  [ "$round" -gt 1 ] && [ "$LEFT" -lt 70 ] && break
  [ "$LEFT" -lt 60 ] && LEFT=60
  echo "round $round" >>"$OUT/ab.md"
  timeout "$LEFT" python3 tests/perf/bench_lora.py ab --model /tmp/q4km.gguf --dir /tmp/loras \
    --device cuda -n 128 --reps 3 --rounds 1 --cases "$CASES" >>"$OUT/ab.md" 2>>"$OUT/ab.err"
done
date -u
{
  echo "## LoRA decode, $GPU, $VER, $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  echo "GPU tests: $(grep -E "passed|failed|error" "$OUT/pytest.log" | tail -1)"
  echo "fused-kernel GPU tests: $(grep -E "passed|failed|error|TIMED" "$OUT/pytest_fused.log" | tail -1)"
  echo
  echo "LoRA deltas alone, one 8B step (128 calls) in a CUDA graph:"
  echo
  cat "$OUT/kernels.md"
  echo
  echo "Ours vs llama.cpp, same f16 GGUF LoRA files, rank 16, Llama-3-8B-shaped Q4_K_M, tg128:"
  echo
  cat "$OUT/compare.md"
  echo
  echo "Kernel schemes (default: two launches, atomic split-K; fused: one launch), tg128, one"
  echo "table per round:"
  echo
  if [ -s "$OUT/ab.md" ]; then cat "$OUT/ab.md"; else echo "(ab cut short; its rounds:)"; grep round "$OUT/ab.err"; fi
} | tee "$OUT/summary.md"
