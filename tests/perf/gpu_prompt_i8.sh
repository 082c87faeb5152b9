#!/usr/bin/env bash
# One device call (~5-6 min), CPU only (issue 39): prompt speed of the native linears' three
# prompt paths - exact fp32 tiles, int16 activations, int8 activations in llama.cpp's formats
# (`kernels/cpu/i8_gemm.h`) - on the GPU machine's quiet CPU, alternating in one process, with
# llama.cpp's llama-bench (built there, GGML_NATIVE) after each round: a Llama-3.2-1B-shaped
# Q4_K_M synthetic and Gemma 3 270M Q4_K_M grown from its skeleton (the real file's tensors and
# types, random blocks), pp512 at 2 threads (the issue's goal) and 16; first the int8 GEMM's tests
# on that CPU (plain C against VNNI bits there) and one linear of each main type alone.
# Prepare here first (all git-excluded; gpu_cpu16.sh says how each was made): .whl,
# .refbuild/gemma3-270m-q4_k_m.skel.gguf, .refbuild/smollm2-q4_1.skel.gguf, .llcpu
# then: carry [".whl", ".refbuild/gemma3-270m-q4_k_m.skel.gguf",
#   ".refbuild/smollm2-q4_1.skel.gguf", ".llcpu"]   (about 13 MiB)
#   bash tests/perf/gpu_prompt_i8.sh
# Environment: THREADS ["2 16"], REPS [2], BUDGET_S [480] (no new model row after that many s);
# for a trial elsewhere: LLAMA_BENCH (one to use instead of building), L1B / GEMMA (files to use
# instead of writing them), NO_PIP=1 (the venv's packages).
# $OUT gets i8.md (the summary), pytest.log and build.log.
set -u
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
OUT=${OUT:-/tmp/out}
THREADS=${THREADS:-2 16} REPS=${REPS:-2}
mkdir -p "$OUT"
LOG="$OUT/i8.md"
if [ -z "${NO_PIP:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  ln -sfn "$PWD" /tmp/site/localllm
  export PYTHONPATH=/tmp/site:$PWD
fi
BUILD=
if [ -z "${LLAMA_BENCH:-}" ]; then  # built in the background while the files are written
  mkdir -p /tmp/llsrc && xz -dc .llcpu/llama-src.tar.xz | tar x -C /tmp/llsrc || exit 1
  (cmake -S /tmp/llsrc/llama.cpp -B /tmp/llcpu -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF >"$OUT/build.log" 2>&1 &&
    cmake --build /tmp/llcpu -j "$(nproc)" --target llama-bench >>"$OUT/build.log" 2>&1) &
  BUILD=$!
  LLAMA_BENCH=/tmp/llcpu/bin/llama-bench
fi
{
  echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores:$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
  echo "# tree $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  grep -o 'avx512_vnni\|avx512_bf16\|amx_int8\|avx_vnni' /proc/cpuinfo | sort -u | tr '\n' ' ' | sed 's/^/# flags: /'
  echo
} | tee "$LOG"
L1B=${L1B:-/tmp/l1b.gguf} GEMMA=${GEMMA:-/tmp/gemma3.gguf}
MAKERS=()
if [ ! -s "$L1B" ]; then
  python3 tests/perf/make_synthetic.py --shape llama3-1b --quant Q4_K_M -o "$L1B" \
    --tokenizer-from .refbuild/smollm2-q4_1.skel.gguf >/tmp/make1b.log 2>&1 &
  MAKERS+=($!)
fi
if [ ! -s "$GEMMA" ]; then
  python3 tests/perf/make_skeleton.py grow .refbuild/gemma3-270m-q4_k_m.skel.gguf -o "$GEMMA" &
  MAKERS+=($!)
fi
# the tests while the files are written and llama.cpp builds (not timed)
OMP_NUM_THREADS=2 timeout 150 python3 -m pytest -q -p no:cacheprovider \
  tests/kernels/test_cpu_i8_gemm.py tests/kernels/test_cpu_i16_gemm.py 2>&1 | tee "$OUT/pytest.log" | tail -3 \
  | sed 's/^/# tests: /' | tee -a "$LOG"
for p in "${MAKERS[@]}"; do wait "$p"; done
echo "## one linear, 512 rows, 2 threads, best of 4 alternating calls" | tee -a "$LOG"
timeout 120 python3 tests/perf/ab_prompt_i8.py --threads 2 -p 512 --shapes Q4_K:2048:8192 \
  Q6_K:2048:8192 Q4_K:8192:2048 Q8_0:2048:2048 Q5_0:2048:640 2>&1 | grep -E "t=|Error" | tee -a "$LOG"
[ -n "$BUILD" ] && wait "$BUILD"
[ -x "$LLAMA_BENCH" ] || { tail -20 "$OUT/build.log"; echo "no llama-bench" | tee -a "$LOG"; }
# the GEMM against that build's own quantization and dots (libggml-cpu beside llama-bench)
GGML=$(dirname "$LLAMA_BENCH")/libggml-cpu.so
[ -f "$GGML" ] && LOCALLLM_GGML_CPU_LIB=$GGML OMP_NUM_THREADS=2 timeout 60 python3 -m pytest -q \
  -p no:cacheprovider tests/kernels/test_cpu_i8_gemm.py -k ggmls_own 2>&1 | tail -1 \
  | sed 's/^/# against libggml-cpu: /' | tee -a "$LOG"
for t in $THREADS; do
  for m in "$L1B" "$GEMMA"; do
    if [ "$SECONDS" -gt "${BUDGET_S:-480}" ]; then
      echo "skipped $(basename "$m") at $t threads: ${SECONDS} s used" | tee -a "$LOG"
      continue
    fi
    echo "## $(basename "$m"), pp512, $t threads, fp32 / int16 / int8 then llama.cpp" | tee -a "$LOG"
    lb=(); [ -x "$LLAMA_BENCH" ] && lb=(--llama-bench "$LLAMA_BENCH")
    timeout 300 python3 tests/perf/ab_prompt_i8.py "$m" --rounds 1 -r "$REPS" --threads "$t" \
      "${lb[@]}" 2>&1 | grep -E "^## |pp512|Error" | tee -a "$LOG"
  done
done
echo "# done $(date -u '+%H:%M:%S UTC'), ${SECONDS} s" | tee -a "$LOG"
