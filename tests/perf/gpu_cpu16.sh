#!/usr/bin/env bash
# One device call (~8 min), CPU only: the GPU machine's 16 cores (issue 39). `localllm bench`
# and llama.cpp's llama-bench alternate on three files at 16 and 8 threads: SmolLM2-135M Q4_1 and
# Gemma 3 270M Q4_K_M grown from their skeletons (the real files' tensors, types and tokenizers
# with random blocks: the real files, 94 and 241 MiB, exceed what a call carries; speed depends
# on shapes and types alone), and the Llama-3.1-8B-shaped Q4_K_M synthetic. Decode is reported
# as GB/s (the bytes a token reads x tokens/s: every tensor, less an untied token_embd) against
# the machine's copy and read bandwidth measured here.
# llama-bench is built there for the CPU alone (GGML_NATIVE, as the CUDA build's CPU backend in
# .llb is: the same code and flags) from the source in .llcpu: .llb (43 MiB) does not fit beside
# the 22.5 MiB tree in the 64 MiB a call carries. With .llb carried instead, LLAMA_BENCH=.llb
# makes the script unpack it and run its llama-bench with `-ngl 0 -dev none`.
#
# Prepare here first (all git-excluded):
#   bash tests/perf/h200_prepare.sh                                # .whl (gguf, llguidance)
#   python tests/perf/make_skeleton.py skeleton SmolLM2-135M-Instruct.Q4_1.gguf \
#     -o .refbuild/smollm2-q4_1.skel.gguf
#   python tests/perf/make_skeleton.py skeleton gemma-3-270m-q4_k_m.gguf \
#     -o .refbuild/gemma3-270m-q4_k_m.skel.gguf
#   mkdir -p .llcpu && echo /.llcpu/ >>.git/info/exclude && tar c -C LLAMA_CPP_PARENT \
#     --exclude=llama.cpp/ggml/src/ggml-cuda --exclude=llama.cpp/tests --exclude=.git llama.cpp \
#     | xz -6 >.llcpu/llama-src.tar.xz        # the llama.cpp tree (h200_prepare's LLAMA=), ~5 MiB
# then: carry [".whl", ".refbuild/smollm2-q4_1.skel.gguf", ".refbuild/gemma3-270m-q4_k_m.skel.gguf",
#   ".llcpu"]   (about 17 MiB)
#   bash tests/perf/gpu_cpu16.sh
# Environment: THREADS ["16 8"], REPS [3], REPS_8B [1], PP [512], TG [128], BUDGET_S [480]
# (no new row starts after that many seconds), END_S [570] (no engine run lasts past it); for a
# trial elsewhere: LLAMA_BENCH (a llama-bench to use instead of building one), LAYERS_8B (fewer
# layers), NO_PIP=1 (the venv's packages).
# $OUT gets cpu16.md and build.log.
set -u
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
OUT=${OUT:-/tmp/out}
THREADS=${THREADS:-16 8} REPS=${REPS:-3} REPS_8B=${REPS_8B:-1} PP=${PP:-512} TG=${TG:-128}
END_S=${END_S:-570}  # the call is killed at 600 s: no engine run goes past this
mkdir -p "$OUT"
LOG="$OUT/cpu16.md"
[ -n "${NO_PIP:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
if [ -z "${NO_PIP:-}" ]; then
  ln -sfn "$PWD" /tmp/site/localllm
  export PYTHONPATH=/tmp/site:$PWD
fi
python3 -c "import llguidance, gguf" || { echo "carry .whl with llguidance and gguf"; exit 1; }
NGL=()
if [ "${LLAMA_BENCH:-}" = .llb ]; then  # the CUDA build, kept off the GPU
  mkdir -p /tmp/llb && cat .llb/llb.part.* | xz -d | tar x -C /tmp/llb || exit 1
  export LD_LIBRARY_PATH=/tmp/llb/bin
  LLAMA_BENCH=/tmp/llb/bin/llama-bench NGL=(-ngl 0 -dev none)
elif [ -z "${LLAMA_BENCH:-}" ]; then  # built in the background while the files are written
  mkdir -p /tmp/llsrc && xz -dc .llcpu/llama-src.tar.xz | tar x -C /tmp/llsrc || exit 1
  (cmake -S /tmp/llsrc/llama.cpp -B /tmp/llcpu -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF >"$OUT/build.log" 2>&1 &&
    cmake --build /tmp/llcpu -j "$(nproc)" --target llama-bench >>"$OUT/build.log" 2>&1) &
  LLAMA_BENCH=/tmp/llcpu/bin/llama-bench
fi
{
  echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores:$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
  echo "# this tree $(git rev-parse --short HEAD 2>/dev/null || echo '?'); GPU (unused): $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
  lscpu | grep -E "^(Socket|Core|Thread|NUMA node\(s\)|L3)" | sed 's/^/# /'
  grep -o -m1 'avx512[a-z_0-9]*\|amx[a-z_0-9]*' /proc/cpuinfo | sort -u | tr '\n' ' ' | sed 's/^/# flags: /'
  echo
} | tee "$LOG"
# the files, side by side (~30-60 s); nothing is timed while they are written
python3 tests/perf/make_synthetic.py --shape llama3-8b --quant Q4_K_M -o /tmp/l8b.gguf \
  ${LAYERS_8B:+--layers $LAYERS_8B} --tokenizer-from .refbuild/smollm2-q4_1.skel.gguf >/tmp/make8b.log 2>&1 &
python3 tests/perf/make_skeleton.py grow .refbuild/smollm2-q4_1.skel.gguf -o /tmp/smollm2.gguf &
python3 tests/perf/make_skeleton.py grow .refbuild/gemma3-270m-q4_k_m.skel.gguf -o /tmp/gemma3.gguf
wait
tail -1 /tmp/make8b.log
[ -x "$LLAMA_BENCH" ] || { tail -20 "$OUT/build.log"; echo "no llama-bench"; exit 1; }
grep -sE "CMAKE_SYSTEM_PROCESSOR|GGML_NATIVE|Adding CPU backend variant|AMX|AVX512" "$OUT/build.log" \
  | sort -u | head -8 | sed 's/^/# llama.cpp build: /' | tee -a "$LOG"
echo "# files written $(date -u +%H:%M:%S)" | tee -a "$LOG"
# the native kernels build once here (not inside a timed run) and say whether they loaded
python3 -c "from localllm.kernels.cpu import native; print('native CPU kernels:', native.load() is not None)" | tee -a "$LOG"

bandwidth() {  # $1 threads: copy (read + write bytes) and read-only (sum) GB/s of 1 GiB, best of 5
  python3 - "$1" <<'EOF'
import sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
src, dst = torch.ones(1 << 28), torch.empty(1 << 28)
def best(f):
    f()
    ts = []
    for _ in range(5):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return min(ts)
c, r = best(lambda: dst.copy_(src)), best(lambda: src.sum())
print(f"bandwidth, {sys.argv[1]} threads: copy {2 * src.nbytes / c / 1e9:.1f} GB/s (read + write), "
      f"read {src.nbytes / r / 1e9:.1f} GB/s")
EOF
}

read_mib() {  # MiB a decode token reads: every tensor, less token_embd where an output head is
  # its own tensor (then one embedding row is read, not the table)
  python3 - "$1" <<'EOF'
import sys, gguf
ts = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(sys.argv[1]).tensors}
skip = ts.get("token_embd.weight", 0) if "output.weight" in ts else 0
print(round((sum(ts.values()) - skip) / 2**20))
EOF
}

row() {  # $1 engine, $2 model, $3 threads, $4 reps: the bench's table rows and decode GB/s
  local mib t0 left
  mib=$(read_mib "$2")
  t0=$(date +%s)
  left=$((END_S - SECONDS)); [ "$left" -gt 200 ] && left=200
  [ "$left" -gt 20 ] || { echo "  ($1: skipped, ${SECONDS} s used)"; return; }
  if [ "$1" = ours ]; then
    timeout "$left" python3 -m localllm.app bench -m "$2" -p "$PP" -n "$TG" -r "$4" -t "$3" 2>&1
  else
    timeout "$left" "$LLAMA_BENCH" -m "$2" -p "$PP" -n "$TG" -r "$4" -t "$3" "${NGL[@]}" 2>&1
  fi | grep -E "^\| [a-z]" | grep -v "^| model" | tee /tmp/row.txt
  awk -F'|' -v mib="$mib" -v who="$1" '/tg[0-9]/ {split($(NF-1), a, " ");
    printf "  %s decode: %.1f GB/s of weights read (%d MiB a token x %s t/s)\n", who,
      mib * 1.048576e6 * a[1] / 1e9, mib, a[1]}' /tmp/row.txt
  echo "  ($1: $(($(date +%s) - t0)) s)"
}

for t in $THREADS; do
  bandwidth "$t" | tee -a "$LOG"
  for m in /tmp/smollm2.gguf /tmp/gemma3.gguf /tmp/l8b.gguf; do
    [ -s "$m" ] || { echo "no $m" | tee -a "$LOG"; continue; }
    if [ "$SECONDS" -gt "${BUDGET_S:-480}" ]; then  # the call's 10 minutes: stop in time
      echo "skipped $(basename "$m") at $t threads: ${SECONDS} s used" | tee -a "$LOG"
      continue
    fi
    reps=$REPS; [ "$m" = /tmp/l8b.gguf ] && reps=$REPS_8B
    { echo "## $(basename "$m") ($(du -m "$m" | cut -f1) MiB), $t threads, $(date -u +%H:%M:%S)"
      echo "- ours:"; row ours "$m" "$t" "$reps"
      echo "- llama.cpp (${NGL[*]:-CPU build}):"; row llama "$m" "$t" "$reps"
    } 2>&1 | tee -a "$LOG"
  done
done
echo "# done $(date -u '+%H:%M:%S UTC')" | tee -a "$LOG"
