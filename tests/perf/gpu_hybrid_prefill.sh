#!/usr/bin/env bash
# One device call (about 4-5 minutes on an H100/H200) for issue 40's hybrid prompt speed
# (Granite-4.0-H-Tiny pp512 was 0.44x llama.cpp, tests/perf/results/hybrid.md):
# 1. GPU tests (while the Granite-4.0-H-Tiny file is written): the chunked Mamba-2 prompt scan
#    against the token-by-token reference (tests/kernels/test_ssd_chunked_triton.py), the mixer's
#    fused end (test_gated_norm.py), the recurrent kernels and the fixtures through them, chunked
#    prompt included (test_recurrent_gpu.py, test_recurrent_triton.py), the hybrids' engine and
#    graph tests.
# 2. `localllm bench -p 512 -n 0 -r 3 --device cuda` next to llama.cpp 3f545bec's
#    `llama-bench -p 512 -n 0 -r 3 -ngl 99` on Granite-4.0-H-Tiny (make_hybrid_synthetic.py,
#    Q4_K_M, random weights).
# 3. tests/perf/profile_hybrid_prefill.py on the same file: eager 512-token prefill wall and host
#    time as shipped (token-by-token scan, fused end), with the chunked scan (opt-in since
#    f0183c3) at IEEE float32 dots and at SSD_DOT_PRECISION (default tf32x3: set for that mode
#    only, the kernel's default stays "ieee"), and with the token loop and the torch end of the
#    mixer (the path before the fused end), alternated; host syncs per forward; a
#    torch.profiler table of the shipped path (kernels by CUDA time, counts; mixer / MoE
#    ranges); the scan alone at the model's shape in a few configurations.
# 4. 2. for Granite-4.0-H-Small (made in the background after Tiny) if it is ready and time is
#    left (BUDGET_S).
# $OUT: pytest.log, profile_g4t.md, bench.md, summary.md (printed last).
#
# Carry [".serve2"] (git-excluded, ~31 MiB, made by tests/perf/serve2_prepare.sh: llama-bench
# and its libraries, the gguf and llguidance wheels) and run from the repo root, timeout 600:
#   bash tests/perf/gpu_hybrid_prefill.sh
# Knobs: BUDGET_S (no new model after this many seconds: 230), END_S (every step's timeout ends
# by then: 290), SMALL (0: skip Granite-4.0-H-Small), TEST_T (test timeout: 110),
# SSD_DOT_PRECISION (the chunked mode's dots in step 3: tf32x3; ieee, tf32).
set -u
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-230}
END_S=${END_S:-290}
SMALL=${SMALL:-1}
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
timeout "${TEST_T:-110}" python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/kernels/test_ssd_chunked_triton.py tests/kernels/test_gated_norm.py \
  tests/kernels/test_recurrent_gpu.py \
  tests/kernels/test_recurrent_triton.py tests/engine/test_hybrid_families_gpu.py \
  tests/engine/test_hybrid_graphs.py 2>&1 | tee "$OUT/pytest.log" | grep -v "^\." | tail -15
echo "tests done at $(($(date +%s) - T0)) s"
rates() {  # the pp512 row's t/s of a bench table
  awk -F'|' '/\| +pp512 +\|/ {gsub(/ /, "", $(NF-1)); split($(NF-1), v, "±"); print v[1]}' "$1" \
    | head -1
}
echo "| model | localllm pp512 t/s | llama.cpp pp512 t/s | ratio |" >"$OUT/summary.md"
echo "|---|---:|---:|---:|" >>"$OUT/summary.md"
for name in g4t g4s; do
  f=$M/$name.gguf
  while [ ! -f $f ] && [ ! -f $M/done ] && [ $(($(date +%s) - T0)) -le "$BUDGET_S" ]; do sleep 2; done
  if [ ! -f $f ] || [ $(($(date +%s) - T0)) -gt "$BUDGET_S" ]; then
    echo "$name: not benched (not made, or past ${BUDGET_S} s)" | tee -a "$OUT/summary.md"
    continue
  fi
  echo "== $name: $(du -h $f | cut -f1), at $(($(date +%s) - T0)) s" | tee -a "$OUT/bench.md"
  : >/tmp/ours.md
  timeout $(left 25) python3 -m localllm.app.bench -m $f -p 512 -n 0 -r 3 --device cuda \
    >/tmp/ours.md 2>/tmp/ours.err
  cat /tmp/ours.md >>"$OUT/bench.md"
  grep -E "Error|error" /tmp/ours.err | tail -3
  : >/tmp/theirs.md
  LD_LIBRARY_PATH=/tmp/llb/bin timeout $(left) $LLB -m $f -p 512 -n 0 \
    -r 3 -ngl 99 >/tmp/theirs.md 2>/tmp/theirs.err || tail -3 /tmp/theirs.err
  cat /tmp/theirs.md >>"$OUT/bench.md"
  a=$(rates /tmp/ours.md)
  b=$(rates /tmp/theirs.md)
  r=$(awk -v a="${a:-0}" -v b="${b:-0}" 'BEGIN { if (a > 0 && b > 0) printf "%.2fx", a / b }')
  echo "| $name | ${a:--} | ${b:--} | ${r:--} |" >>"$OUT/summary.md"
  if [ $name = g4t ]; then  # after the headline figures: the breakdown
    timeout $(left 20) python3 tests/perf/profile_hybrid_prefill.py -m $f -p 512 \
      --chunk-precision "${SSD_DOT_PRECISION:-tf32x3}" \
      2>/tmp/prof.err | tee "$OUT/profile_$name.md"
    grep -E "Error|error" /tmp/prof.err | tail -3
  fi
  rm -f $f
done
tail -4 /tmp/make.log
echo
echo "g4t = Granite-4.0-H-Tiny, g4s = Granite-4.0-H-Small; Q4_K_M random weights, on the GPU"
tail -3 "$OUT/pytest.log"
grep -E "^\| (chunked|token)|^host syncs|^### profiler" "$OUT/profile_g4t.md" 2>/dev/null
grep -E "^(token by token|chunked )" "$OUT/profile_g4t.md" 2>/dev/null
cat "$OUT/summary.md"
echo "total $(($(date +%s) - T0)) s"
