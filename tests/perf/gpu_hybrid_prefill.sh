#!/usr/bin/env bash
# One device call (about 6-8 minutes on an H100/H200; every step ends by END_S) for issue 40's
# hybrid prompt speed (H100 12:30 UTC 2026-12-06: Granite-4.0-H-Tiny pp512 0.70x llama.cpp,
# -Small 0.82x; Tiny's eager forward host-bound, tests/perf/results/hybrid.md):
# 1. GPU tests (while the model files are written): hybrid prompt CUDA graphs against eager
#    prompts and the engine's tokens with them on and off (test_hybrid_prompt_graphs.py), the
#    transformers' prompt graphs (test_prefill_graphs.py), the chunked Mamba-2 scan, the fused
#    end, the recurrent kernels, the hybrids' engine and decode-graph tests.
# 2. Per model (Granite-4.0-H-Tiny, then -Small; make_hybrid_synthetic.py, Q4_K_M, random
#    weights, everything on the GPU), `localllm bench` through tests/perf/bench_switches.py, the
#    switch A/B in one call: A as shipped (-p 512 -n 128), B hybrid prompt graphs on
#    (prefill_graphs.STATEFUL; -p 512 -n 0), C graphs and the chunked scan at tf32x3 dots
#    (CHUNKED_MIN_ROWS 64, SSD_DOT_PRECISION; -p 512 -n 0); then llama.cpp 3f545bec's
#    `llama-bench -p 512 -n 128 -r 3 -ngl 99` on the same file.
# 3. tests/perf/profile_hybrid_prefill.py on each file: the pp512 forward eager and as a prompt
#    graph, token-by-token and chunked scans (ieee and tf32x3), alternated in one process; for
#    Tiny also host syncs and a profiler table of the shipped path; the scan alone.
# $OUT: pytest.log, bench.md, profile_g4t.md, profile_g4s.md, summary.md (printed last).
#
# Carry [".serve2"] (git-excluded, ~31 MiB, made by tests/perf/serve2_prepare.sh: llama-bench
# and its libraries, the gguf and llguidance wheels) and run from the repo root, timeout 600:
#   bash tests/perf/gpu_hybrid_prefill.sh
# Knobs: BUDGET_S (no new model after this many seconds: 330), END_S (every step's timeout ends
# by then: 520), SMALL (0: skip Granite-4.0-H-Small), TEST_T (test timeout: 150),
# SSD_DOT_PRECISION (config C's and the profile's chunked dots: tf32x3; ieee, tf32).
set -u
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-330}
END_S=${END_S:-520}
SMALL=${SMALL:-1}
PREC=${SSD_DOT_PRECISION:-tf32x3}
left() {  # seconds left before END_S, less $1, at least 5
  local t=$((END_S - ($(date +%s) - T0) - ${1:-0}))
  echo $((t > 5 ? t : 5))
}
mkdir -p /tmp/site /tmp/llb
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .serve2/whl/gguf-*.whl .serve2/whl/llguidance-*.whl 2>&1 | tail -2
[ -x /tmp/llb/bin/llama-bench ] || cat .serve2/llb.part.* | xz -d | tar x -C /tmp/llb
ln -sfn "$PWD" /tmp/site/localllm
export PYTHONPATH=/tmp/site:$PWD
LLB=/tmp/llb/bin/llama-bench
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  date -u; } | tee "$OUT/bench.md"
TOK=tests/data/families/qwen3next.gguf  # a converter-made tokenizer, small vocabulary
M=/tmp/models
mkdir -p $M
mk() {  # name shape: <name>.gguf appears once complete
  python3 tests/perf/make_hybrid_synthetic.py --shape "$2" --tokenizer-from $TOK -o $M/$1.part \
    >>/tmp/make.log 2>&1 && mv $M/$1.part $M/$1.gguf || echo "$1: making failed" >>/tmp/make.log
}
( mk g4t granite-4.0-h-tiny
  [ "$SMALL" = 1 ] && mk g4s granite-4.0-h-small
  touch $M/done ) &
timeout "${TEST_T:-150}" python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/engine/test_hybrid_prompt_graphs.py tests/engine/test_prefill_graphs.py \
  tests/kernels/test_ssd_chunked_triton.py tests/kernels/test_gated_norm.py \
  tests/kernels/test_recurrent_gpu.py \
  tests/kernels/test_recurrent_triton.py tests/engine/test_hybrid_families_gpu.py \
  tests/engine/test_hybrid_graphs.py 2>&1 | tee "$OUT/pytest.log" | grep -v "^\." | tail -15
echo "tests done at $(($(date +%s) - T0)) s"
rate() {  # rate FILE TEST: the t/s of a bench table's TEST row (pp512, tg128)
  awk -F'|' -v t="$2" '$0 ~ "\\| +" t " +\\|" {gsub(/ /, "", $(NF-1)); split($(NF-1), v, "±");
    print v[1]}' "$1" | head -1
}
ratio() { awk -v a="${1:-0}" -v b="${2:-0}" 'BEGIN { if (a > 0 && b > 0) printf "%.2fx", a / b }'; }
{ echo "| model | test | A shipped | B prompt graphs | C graphs + chunked $PREC | llama.cpp |" \
    "A / B / C vs llama.cpp |"
  echo "|---|---|---:|---:|---:|---:|---|"; } >"$OUT/summary.md"
ours() {  # ours CONFIG SWITCHES... -- BENCH ARGS: one bench run into /tmp/<CONFIG>.md
  local cfg=$1
  shift
  : >/tmp/$cfg.md
  echo "-- $cfg: $*" >>"$OUT/bench.md"
  timeout $(left 40) python3 tests/perf/bench_switches.py "$@" >/tmp/$cfg.md 2>/tmp/$cfg.err
  cat /tmp/$cfg.md >>"$OUT/bench.md"
  grep -E "^switches|Error|error|not captured" /tmp/$cfg.err | tail -3 | tee -a "$OUT/bench.md"
}
for name in g4t g4s; do
  f=$M/$name.gguf
  while [ ! -f $f ] && [ ! -f $M/done ] && [ $(($(date +%s) - T0)) -le "$BUDGET_S" ]; do sleep 2; done
  if [ ! -f $f ] || [ $(($(date +%s) - T0)) -gt "$BUDGET_S" ]; then
    echo "$name: not benched (not made, or past ${BUDGET_S} s)" | tee -a "$OUT/summary.md"
    continue
  fi
  echo "== $name: $(du -h $f | cut -f1), at $(($(date +%s) - T0)) s" | tee -a "$OUT/bench.md"
  args=(-m $f -r 3 --device cuda)
  ours A --prompt-graphs 0 -- "${args[@]}" -p 512 -n 128
  ours B --prompt-graphs 1 -- "${args[@]}" -p 512 -n 0
  ours C --prompt-graphs 1 --chunked-rows 64 --dot-precision "$PREC" -- "${args[@]}" -p 512 -n 0
  : >/tmp/theirs.md
  LD_LIBRARY_PATH=/tmp/llb/bin timeout $(left 30) $LLB -m $f -p 512 -n 128 \
    -r 3 -ngl 99 >/tmp/theirs.md 2>/tmp/theirs.err || tail -3 /tmp/theirs.err
  cat /tmp/theirs.md >>"$OUT/bench.md"
  for t in pp512 tg128; do
    a=$(rate /tmp/A.md $t) b=$(rate /tmp/B.md $t) c=$(rate /tmp/C.md $t) l=$(rate /tmp/theirs.md $t)
    echo "| $name | $t | ${a:--} | ${b:--} | ${c:--} | ${l:--} |" \
      "$(ratio "$a" "$l") / $(ratio "$b" "$l") / $(ratio "$c" "$l") |" >>"$OUT/summary.md"
  done
  light=()
  [ $name = g4s ] && light=(--no-profile --reps 3)
  timeout $(left 5) python3 tests/perf/profile_hybrid_prefill.py -m $f -p 512 \
    --chunk-precision "$PREC" ${light[@]+"${light[@]}"} 2>/tmp/prof.err | tee "$OUT/profile_$name.md"
  grep -E "Error|error" /tmp/prof.err | tail -3
  rm -f $f
done
tail -4 /tmp/make.log
echo
echo "g4t = Granite-4.0-H-Tiny, g4s = Granite-4.0-H-Small; Q4_K_M random weights, on the GPU"
tail -3 "$OUT/pytest.log"
for name in g4t g4s; do
  [ -f "$OUT/profile_$name.md" ] || continue
  echo "profile $name (eager / prompt graph, alternated in one process):"
  grep -E "^\| (chunked|token|prompt)|^host syncs|^### profiler" "$OUT/profile_$name.md"
  grep -E "^(token by token|chunked tf32x3, L 64, BP 32, 4 warps)" "$OUT/profile_$name.md"
done
cat "$OUT/summary.md"
echo "total $(($(date +%s) - T0)) s"
