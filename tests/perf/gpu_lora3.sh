#!/usr/bin/env bash
# One device call (~4-5 min on an H100/H200), issue 36: the LoRA expand in the base GEMVs'
# epilogue (engine.lora.delta.SCHEME = "epilogue"), and the shrink in them too ("inline"),
# against the default two-launch kernels ("atomic").
#  tests: the `-m gpu` tests of the epilogue (tests/kernels/test_lora_epilogue.py: the packed
#     GEMV + epilogue against its references; tests/lora/test_lora_epilogue_gpu.py: a Q8_0 model
#     with PEFT adapters, logits and graph decode against the torch ops and the default scheme),
#     the default kernels' (test_lora_kernels.py; with STEPS containing "more" test_lora_gpu.py
#     too) and the packed GEMVs' own (test_triton_packed.py: the base path, LR = 0, one row);
#  bench: tests/perf/bench_lora_epilogue.py, one 8B step's 128 packed GEMVs in a CUDA graph, base
#     / + atomic / epilogue / inline LoRA, 1 and 4 rank-16 adapters, 1 and 4 rows (us per step);
#  ab: decode on the Llama-3-8B-shaped Q4_K_M (make_synthetic.py), `bench_lora.py ab` rounds of
#     base, 1 and 4 rank-16 f16 adapters with the default scheme, "epilogue" and "inline" (each
#     case its own `localllm bench` process, alternated; rounds while time is left).
# STEPS picks parts (default "tests bench ab"); ROUNDS (default 3) caps the A/B rounds. All three
# in one call leave the A/B ~2 min (one round of 7 cases may not fit): better two calls,
# STEPS="tests bench" then STEPS=ab.
# Prepare here first: `bash tests/perf/h200_prepare.sh` (.whl, .refbuild/smollm2-tok.gguf); run
# from the repository root carrying [".whl", ".refbuild/smollm2-tok.gguf"].
# $OUT collects pytest.log, pytest_packed.log, epilogue.md/.err, ab.md/.err and summary.md
# (printed last).
set -u
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
OUT=${OUT:-/tmp/out}
STEPS=${STEPS:-tests bench ab}
mkdir -p "$OUT"
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
ln -sfn "$PWD" /tmp/site/localllm
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import llguidance, gguf" || { echo "carry .whl with llguidance and gguf"; exit 1; }
GPU=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)
VER=$(python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)")
echo "$GPU / $VER / STEPS=$STEPS"
date -u
has() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }
if has ab; then
  python3 tests/perf/make_synthetic.py --shape llama3-8b --quant Q4_K_M -o /tmp/q4km.gguf \
    --tokenizer-from .refbuild/smollm2-tok.gguf >/tmp/make.log 2>&1 &
  GEN=$!
fi
: >"$OUT/pytest.log"; : >"$OUT/pytest_packed.log"
if has tests; then
  TESTS="tests/kernels/test_lora_epilogue.py tests/lora/test_lora_epilogue_gpu.py"
  TESTS="$TESTS tests/lora/test_lora_epilogue_module.py"
  TESTS="$TESTS tests/kernels/test_lora_kernels.py"
  has more && TESTS="$TESTS tests/lora/test_lora_gpu.py"
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -k "not fused" $TESTS 2>&1 \
    | tee "$OUT/pytest.log" | grep -v "^\." | tail -25
  # the base GEMVs (LR = 0) against their oracle: the Llama-3-8B shapes, one row
  K1="gemv_packed_matches_reference and not 3-shape and not 8-shape"
  timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider -k "$K1" \
    tests/kernels/test_triton_packed.py 2>&1 | tee "$OUT/pytest_packed.log" | tail -3
  date -u
fi
: >"$OUT/epilogue.md"
if has bench; then
  timeout 120 python3 tests/perf/bench_lora_epilogue.py >"$OUT/epilogue.md" 2>"$OUT/epilogue.err"
  cat "$OUT/epilogue.md"; tail -3 "$OUT/epilogue.err"
  date -u
fi
: >"$OUT/ab.md"
if has ab; then
  wait $GEN || { tail -5 /tmp/make.log; exit 1; }
  python3 tests/perf/bench_lora.py make --model /tmp/q4km.gguf --out /tmp/loras --rank 16 \
    --count 4 --dtype f16 >/dev/null
  CASES="base;1 adapter, atomic;1 adapter, epilogue;1 adapter, inline;4 adapters, atomic"
  CASES="$CASES;4 adapters, epilogue;4 adapters, inline"
  for round in $(seq "${ROUNDS:-3}"); do
    LEFT=$((290 - $(date +%s) + T0))
    [ "$round" -gt 1 ] && [ "$LEFT" -lt 70 ] && break
    [ "$LEFT" -lt 60 ] && LEFT=60
    echo "round $round" >>"$OUT/ab.md"
    timeout "$LEFT" python3 tests/perf/bench_lora.py ab --model /tmp/q4km.gguf --dir /tmp/loras \
      --device cuda -n 128 --reps 3 --rounds 1 --cases "$CASES" >>"$OUT/ab.md" 2>>"$OUT/ab.err"
  done
  date -u
fi
{
  echo "## LoRA expand in the GEMV epilogue, $GPU, $VER, $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  echo "GPU tests: $(grep -E "passed|failed|error" "$OUT/pytest.log" | tail -1)"
  grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -10
  echo "packed GEMVs, base path: $(grep -E "passed|failed|error" "$OUT/pytest_packed.log" | tail -1)"
  echo
  echo "One 8B step's 128 packed GEMVs in a CUDA graph, base / atomic / epilogue / inline LoRA:"
  echo
  cat "$OUT/epilogue.md"
  echo
  echo "Decode, Llama-3-8B-shaped Q4_K_M, rank-16 f16 adapters, tg128 (one table per round):"
  echo
  if [ -s "$OUT/ab.md" ]; then cat "$OUT/ab.md"; else grep round "$OUT/ab.err" 2>/dev/null; fi
} | tee "$OUT/summary.md"
