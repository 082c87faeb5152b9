#!/usr/bin/env bash
# CPU decode and prompt speed: this tree, llama.cpp's llama-bench and an older tree of ours,
# alternating in one run (a shared or busy box's load falls on all three alike), plus peak RSS.
# Not a test: its log goes, with the machine and date, into tests/perf/results/cpu.md.
#
#   tests/perf/cpu_vs_llamacpp.sh MODEL.gguf [MODEL.gguf ...]
#
# Environment (defaults in brackets):
#   LLAMA_BENCH  llama-bench built from ngxson/llama.cpp with -DGGML_NATIVE=OFF -DGGML_AVX2=ON
#                -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF
#                -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF [/work/llamacpp/src/build/bin/llama-bench]
#   OLD_REV      the older tree to compare with (a commit; empty: skip) [692bea1, before issue 39]
#   THREADS [2]  ROUNDS [2]  REPS [3]  PP [512]  TG [128]  PYTHON [python: the venv's, on PATH]
set -euo pipefail
LLAMA_BENCH=${LLAMA_BENCH:-/work/llamacpp/src/build/bin/llama-bench}
OLD_REV=${OLD_REV-692bea1}
THREADS=${THREADS:-2} ROUNDS=${ROUNDS:-2} REPS=${REPS:-3} PP=${PP:-512} TG=${TG:-128}
PYTHON=${PYTHON:-python}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
[ $# -ge 1 ] || { echo "usage: $0 MODEL.gguf [MODEL.gguf ...]" >&2; exit 2; }
[ -x "$LLAMA_BENCH" ] || { echo "no llama-bench at $LLAMA_BENCH (set LLAMA_BENCH)" >&2; exit 2; }

OLD=""
if [ -n "$OLD_REV" ]; then  # the older tree as package `localllm` on PYTHONPATH (ahead of ours)
  OLD=$(mktemp -d)
  git -C "$ROOT" archive "$OLD_REV" | tar -x -C "$OLD" --one-top-level=localllm
  trap 'rm -rf "$OLD"' EXIT
fi

ours() {  # $1: model; $2: PYTHONPATH ("" for this tree)
  PYTHONPATH="$2" /usr/bin/time -f "peak RSS %M KiB" "$PYTHON" -m localllm.app bench -m "$1" \
    -p "$PP" -n "$TG" -r "$REPS" -t "$THREADS" 2>&1 | grep -E "^\||peak RSS"
}

echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
echo "# this tree $(git -C "$ROOT" rev-parse --short HEAD), old tree ${OLD_REV:-none}, threads $THREADS"
for model in "$@"; do
  echo "## $(basename "$model") ($(du -m "$model" | cut -f1) MiB)"
  for round in $(seq "$ROUNDS"); do
    echo "### round $round; load: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "- ours:"; ours "$model" ""
    echo "- llama.cpp:"
    /usr/bin/time -f "peak RSS %M KiB" "$LLAMA_BENCH" -m "$model" -p "$PP" -n "$TG" \
      -r "$REPS" -t "$THREADS" 2>&1 | grep -E "^\||peak RSS"
    if [ -n "$OLD" ]; then echo "- old ours:"; ours "$model" "$OLD"; fi
  done
done
echo "# done $(date -u '+%H:%M UTC'); load: $(cut -d' ' -f1-3 /proc/loadavg)"
