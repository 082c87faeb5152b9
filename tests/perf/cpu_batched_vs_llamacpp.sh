#!/usr/bin/env bash
# CPU batched decode: this tree's engine (tests/perf/bench_engine.py section 1: c concurrent
# requests of PROMPT prompt tokens and GEN generated tokens each, all submitted at once) and
# llama.cpp's llama-batched-bench (-npp PROMPT -ntg GEN -npl c: c sequences decoded together),
# alternating round by round so a busy box's load falls on both alike. Not a test: its log goes,
# with the machine and date, into tests/perf/results/cpu.md.
#
#   tests/perf/cpu_batched_vs_llamacpp.sh MODEL.gguf
#
# Decode throughput compared: llama.cpp's S_TG (c x GEN tokens over the decode time) against
# ours c / mean TPOT (each request's tokens after its first, over their time).
# Environment (defaults in brackets): BATCHED_BENCH [/work/llama-cpu/build/bin/llama-batched-bench,
# built from the same tree as cpu_vs_llamacpp.sh's llama-bench]; THREADS [2]; ROUNDS [2];
# CONC [1,4,16]; PROMPT [64]; GEN [64]; PYTHON [python].
set -euo pipefail
BATCHED_BENCH=${BATCHED_BENCH:-/work/llama-cpu/build/bin/llama-batched-bench}
THREADS=${THREADS:-2} ROUNDS=${ROUNDS:-2} CONC=${CONC:-1,4,16} PROMPT=${PROMPT:-64} GEN=${GEN:-64}
PYTHON=${PYTHON:-python}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
[ $# -eq 1 ] || { echo "usage: $0 MODEL.gguf" >&2; exit 2; }
[ -x "$BATCHED_BENCH" ] || { echo "no llama-batched-bench at $BATCHED_BENCH" >&2; exit 2; }
max=$(echo "$CONC" | tr ',' '\n' | sort -n | tail -1)
ctx=$((max * (PROMPT + GEN)))
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores:$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
echo "# this tree $(git -C "$ROOT" rev-parse --short HEAD), threads $THREADS, $(basename "$1")"
for round in $(seq "$ROUNDS"); do
  echo "## round $round; load: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "- llama.cpp:"
  "$BATCHED_BENCH" -m "$1" -c "$ctx" -b 512 -ub 512 -npp "$PROMPT" -ntg "$GEN" -npl "$CONC" \
    -t "$THREADS" -fa off 2>&1 | grep -E "^\|"
  echo "- ours:"
  PYTHONSAFEPATH=1 "$PYTHON" "$ROOT/tests/perf/bench_engine.py" --model "$1" --threads "$THREADS" \
    --sections 1 --concurrency "$CONC" --prompt-len "$PROMPT" --gen "$GEN" --reps 1 \
    --max-model-len $((PROMPT + GEN + 16)) 2>&1 | grep -E "^\|"
done
echo "# done $(date -u '+%H:%M UTC'); load: $(cut -d' ' -f1-3 /proc/loadavg)"
