#!/usr/bin/env bash
# One device call (<= 9.5 min on an H100/H200) that needs no llama.cpp build: the GPU checks
# and our own A/B of three switches that ship off until a GPU has shown them (issues 35, 36, 40).
#   tests    pytest -m gpu: the LoRA epilogue / inline schemes against float64 deltas
#            (tests/lora/test_lora_epilogue_*.py, test_lora_epilogue.py, test_lora_kernels.py),
#            hybrid prompt graphs on the synthetic hybrids (test_hybrid_prompt_graphs.py,
#            test_prefill_graphs.py), then the half GEMM / quant GPU test fixes of 7274667 and
#            the Gemma 3 / LLaVA towers (test_linear_half.py, test_quant_gpu.py,
#            test_vision_gpu_gemma3_llava.py) where time is left
#   lora     decode overhead of 1 and 4 rank-16 f16 adapters over our base on the
#            Llama-3.1-8B-shape Q4_K_M (`bench_lora.py ab`, each case its own `localllm bench`
#            process): "epilogue" (the default: the norm / SiLU kernels run the shrinks of
#            q|k|v, gate|up and down), "epilogue launched" (every shrink its own launch) and
#            "inline"; LORA_CASES overrides (issue 36's goal is <= 10 % over the base); e.g.
#            "base;1 adapter, epilogue;1 adapter, producers split;4 adapters, epilogue launched;
#            4 adapters, producers;4 adapters, producers split" (every shrink in the input
#            kernels whatever its rank, the SiLU's and combine's split over more programs)
#   lorak    tests/perf/decode_kernels.py on the same file, depth 512: the decode step kernel by
#            kernel with no adapter, one and four (where LoRA's +16 % / +46 % goes; issue 36)
#   tests3   pytest -m gpu: the packed linears' paths by row count (the int8 GEMM past 8 rows),
#            fused linears, the grouped GEMMs, the flash-decoding combine (its LoRA shrink)
#   tests4   pytest -m gpu: the LoRA shrinks in the norm / SiLU / attention kernels (up to
#            four rank-16 adapters' stacked ranks: 192, 64), the epilogue schemes through the
#            whole model, the flash-decoding combine (issue 36)
#   tests5   pytest -m gpu: the batch GEMM over packed blocks (9-64 rows) against the bf16 copy
#            and gguf, and every packed linear path by row count (issue 38)
#   dense    tests/perf/bench_dense_rows.py: one 8B layer's packed linears at 1-64 rows, the
#            batch GEMM and the int8 GEMM against the bf16 copy of the weight; SWEEP=1 adds the
#            batch GEMM's geometry sweep at 16 and 64 rows (issue 38)
#   batch    tests/perf/bench_engine.py section 1 on the 8B Q4_K_M, 1 / 16 / 64 concurrent
#            requests of 128 + 128 tokens, triton_linear.$SWITCH on and off (SWITCH: BATCH_GEMM,
#            the default, or DENSE_INT8; issue 38)
#   hybrid   tests/perf/profile_hybrid_prefill.py on a Granite-4.0-H-Tiny-shape Q4_K_M: pp512
#            eager and as a prompt graph, token-by-token scan against the chunked one at IEEE
#            and tf32x3 dots, alternated in one process (issue 40)
#   pipe     the packed GEMVs' loop over blocks in cp.async stages (triton_packed.GEMV_STAGES,
#            off): their GPU tests with 3 stages, `bench_gpu.py packed pipe` (stages x programs per
#            launch for the 8B's Q4_K / Q6_K shapes), then `localllm bench -p 512 -n 128` on the
#            8B Q4_K_M at 1, 2 and 3 stages (PIPE_TARGET: programs per launch with stages, 2048),
#            two rounds alternating (issue 38's single stream); PIPE_SWEEP=0: the benches alone
#   route    pytest -m gpu tests/kernels/test_moe_route.py, then `localllm bench -p 512 -n 128`
#            on an LFM2-8B-A1B-shape Q4_K_M (sigmoid routing with a choice bias) with
#            engine.moe.block.SCORED_ROUTE_KERNEL off and on, two rounds alternating (issue 40)
# Prepare here: `bash tests/perf/h200_prepare.sh` (.whl, .refbuild/smollm2-tok.gguf); carry
# [".whl", ".refbuild/smollm2-tok.gguf"] (or [".serve2"]: its wheels and tokenizer serve too);
# from the repo root: bash tests/perf/gpu_switches.sh. A /tmp/q4km.gguf already there is used.
# Knobs: STEPS ("tests1 lora hybrid tests2"; also tests3, tests4, tests5, dense, batch), END_S
# (560: no step's timeout runs past it), SWITCH, SWEEP.
# $OUT: pytest1.log, pytest2.log, lora_ab.md, profile_g4t.md, summary.md (printed last).
set -u
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
OUT=${OUT:-/tmp/out}
STEPS=${STEPS:-tests1 lora hybrid tests2}
END_S=${END_S:-560}
SWITCH=${SWITCH:-BATCH_GEMM}
mkdir -p "$OUT"
# the wheels and tokenizer from .whl / .refbuild, or from .serve2 (serve2_prepare.sh) alone
WHL=.whl
[ -d $WHL ] || WHL=.serve2/whl
TOK=.refbuild/smollm2-tok.gguf
[ -f $TOK ] || TOK=.serve2/smollm2-tok.gguf
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  $WHL/*.whl
ln -sfn "$PWD" /tmp/site/localllm
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git log -1 --format='commit %h %s' 2>/dev/null; date -u; } | tee "$OUT/summary.md"
cap() { local t=$((END_S - SECONDS)); [ "$t" -lt "$1" ] || t=$1; [ "$t" -gt 5 ] || t=5; echo $t; }
has() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }
# the files, written on the host's cores while the first tests use the GPU
if [ -f /tmp/q4km.gguf ]; then  # written by an earlier script of the same call
  G8_RC=0
elif has lora || has batch || has lorak || has pipe; then
  (python3 tests/perf/make_synthetic.py --shape llama3-8b --quant Q4_K_M -o /tmp/q4km.part \
    --tokenizer-from $TOK >/tmp/make8b.log 2>&1 && mv /tmp/q4km.part /tmp/q4km.gguf) &
  G8=$!
fi
if has route; then
  (python3 tests/perf/make_hybrid_synthetic.py --shape lfm2-8b-a1b \
    --tokenizer-from tests/data/families/qwen3next.gguf -o /tmp/l2m.part >/tmp/makel2m.log 2>&1 \
    && mv /tmp/l2m.part /tmp/l2m.gguf) &
  GR=$!
fi
if has hybrid; then
  (python3 tests/perf/make_hybrid_synthetic.py --shape granite-4.0-h-tiny \
    --tokenizer-from tests/data/families/qwen3next.gguf -o /tmp/g4t.part >/tmp/makeg4t.log 2>&1 \
    && mv /tmp/g4t.part /tmp/g4t.gguf) &
  GH=$!
fi
gpu_tests() {  # gpu_tests LOG SECONDS FILES...
  local log=$1 t=$2
  shift 2
  timeout "$(cap "$t")" python3 -m pytest -q -m gpu -p no:cacheprovider -rf "$@" 2>&1 \
    | tee "$OUT/$log" | grep -v "^\." | tail -20
  echo "$log: $(tail -1 "$OUT/$log")" >>"$OUT/summary.md"
}
have8b() {  # the 8B file is written (waits for its writer once; later steps reuse the answer)
  if [ -z "${G8_RC:-}" ]; then wait "$G8"; G8_RC=$?; fi
  [ "$G8_RC" = 0 ] || { tail -3 /tmp/make8b.log; return 1; }
}
make_loras() {  # four rank-16 f16 adapters for /tmp/q4km.gguf in /tmp/loras (once)
  [ -f /tmp/loras/lora-3.gguf ] || python3 tests/perf/bench_lora.py make --model /tmp/q4km.gguf \
    --out /tmp/loras --rank 16 --count 4 --dtype f16 >/dev/null
}
for step in $STEPS; do
  echo "== $step at ${SECONDS}s"
  case $step in
    tests1) gpu_tests pytest1.log 140 tests/lora/test_lora_epilogue_gpu.py \
        tests/lora/test_lora_producer_shrink.py tests/lora/test_lora_epilogue_module.py tests/kernels/test_lora_epilogue.py \
        tests/kernels/test_lora_kernels.py tests/engine/test_hybrid_prompt_graphs.py \
        tests/engine/test_prefill_graphs.py ;;
    lora) have8b || continue
      make_loras
      CASES="base;1 adapter, epilogue;1 adapter, epilogue launched;4 adapters, epilogue"
      CASES=${LORA_CASES:-"$CASES;4 adapters, epilogue launched"}
      timeout "$(cap 150)" python3 tests/perf/bench_lora.py ab --model /tmp/q4km.gguf \
        --dir /tmp/loras --device cuda -n 128 --reps 3 --rounds 1 --cases "$CASES" \
        >"$OUT/lora_ab.md" 2>/tmp/lora_ab.err
      tail -3 /tmp/lora_ab.err
      { echo "## lora ab"; cat "$OUT/lora_ab.md"; } | tee -a "$OUT/summary.md" ;;
    lorak) have8b || continue
      make_loras
      for n in 0 1 4; do
        args=(); for i in $(seq 0 $((n - 1))); do args+=(--lora "/tmp/loras/lora-$i.gguf"); done
        echo "### $n adapters" | tee -a "$OUT/lorak.md"
        timeout "$(cap 80)" python3 tests/perf/decode_kernels.py /tmp/q4km.gguf --depth 512 \
          "${args[@]}" >>"$OUT/lorak.md" 2>/tmp/lorak.err
        grep -E "^depth" "$OUT/lorak.md" | tail -1
        tail -2 /tmp/lorak.err
      done
      { echo "## lora kernels"; grep -E "^(###|depth|\| )" "$OUT/lorak.md"; } >>"$OUT/summary.md" ;;
    tests3) gpu_tests pytest3.log 120 tests/kernels/test_triton_gemv.py -k both_paths \
        tests/engine/test_fused_linear.py tests/kernels/test_moe_grouped.py \
        tests/kernels/test_flash_decode.py tests/engine/test_combine_quant.py \
        tests/engine/test_gpu_engine.py tests/engine/test_converted_families_gpu.py ;;
    tests4) gpu_tests pytest4.log 200 tests/lora/test_lora_producer_shrink.py \
        tests/lora/test_lora_epilogue_gpu.py tests/kernels/test_lora_epilogue.py \
        tests/kernels/test_flash_decode.py::test_combine_adds_the_output_projections_lora_shrink ;;
    tests5) gpu_tests pytest5.log 100 tests/kernels/test_batch_gemm.py \
        tests/kernels/test_triton_gemv.py -k "both_paths or batch" ;;
    dense) if [ "${SWEEP:-0}" = 1 ]; then rows=(--rows 1,4,5,8,9,16,32,64 --sweep); else rows=(); fi
      timeout "$(cap 150)" python3 tests/perf/bench_dense_rows.py --reps 30 "${rows[@]}" \
        2>/tmp/dense.err | tee "$OUT/dense.md"
      tail -3 /tmp/dense.err
      { echo "## dense rows"; cat "$OUT/dense.md"; } >>"$OUT/summary.md" ;;
    batch) have8b || continue
      for on in True False; do
        echo "### $SWITCH = $on" | tee -a "$OUT/batch.md"
        timeout "$(cap 100)" python3 tests/perf/with_switches.py \
          "localllm.kernels.quant.triton_linear.$SWITCH=$on" -- tests/perf/bench_engine.py \
          --model /tmp/q4km.gguf \
          --device cuda --sections 1 --concurrency 1,16,64 --prompt-len 128 --gen 128 --reps 1 \
          --max-model-len 512 2>/tmp/batch.err | tee -a "$OUT/batch.md"
        tail -3 /tmp/batch.err
      done
      { echo "## batch"; cat "$OUT/batch.md"; } >>"$OUT/summary.md" ;;
    hybrid) wait $GH || { tail -3 /tmp/makeg4t.log; continue; }
      timeout "$(cap 110)" python3 tests/perf/profile_hybrid_prefill.py -m /tmp/g4t.gguf -p 512 \
        --chunk-precision tf32x3 2>/tmp/prof.err | tee "$OUT/profile_g4t.md" | tail -30
      grep -E "Error|error" /tmp/prof.err | tail -3
      { echo "## hybrid (g4t)"
        grep -E "^\| (chunked|token|prompt)|^host syncs" "$OUT/profile_g4t.md"
        grep -E "^(token by token|chunked tf32x3, L 64, BP 32, 4 warps)" "$OUT/profile_g4t.md"
      } >>"$OUT/summary.md" ;;
    route) gpu_tests pytestr.log 60 tests/kernels/test_moe_route.py
      wait $GR || { tail -3 /tmp/makel2m.log; continue; }
      for round in 1 2; do
        for on in False True; do
          echo "### round $round, SCORED_ROUTE_KERNEL = $on" | tee -a "$OUT/route.md"
          timeout "$(cap 60)" python3 tests/perf/with_switches.py \
            "localllm.engine.moe.block.SCORED_ROUTE_KERNEL=$on" -- -m localllm.app.bench \
            -m /tmp/l2m.gguf -p 512 -n 128 -r 3 --device cuda 2>/tmp/route.err \
            | grep -E "pp512|tg128" | tee -a "$OUT/route.md"
          tail -2 /tmp/route.err
        done
      done
      { echo "## route (LFM2-8B-A1B)"; cat "$OUT/route.md"; } >>"$OUT/summary.md" ;;
    pipe) Q=localllm.kernels.quant.triton_packed
      [ "${PIPE_SWEEP:-1}" = 1 ] && timeout "$(cap 90)" python3 tests/perf/with_switches.py \
        "$Q.GEMV_STAGES=3" -- -m pytest -q \
        -m gpu -p no:cacheprovider -rf tests/kernels/test_triton_packed.py \
        tests/kernels/test_triton_gemv.py tests/kernels/test_pdl.py 2>&1 | tee "$OUT/pytestp.log" \
        | grep -v "^\." | tail -12
      [ -f "$OUT/pytestp.log" ] \
        && echo "pytestp.log (GEMV_STAGES=3): $(tail -1 "$OUT/pytestp.log")" >>"$OUT/summary.md"
      [ "${PIPE_SWEEP:-1}" = 1 ] && timeout "$(cap 200)" python3 tests/perf/bench_gpu.py packed \
        pipe 2>/tmp/pipe.err | tee "$OUT/pipe.md" | grep -E "^best" && tail -3 /tmp/pipe.err
      have8b || continue
      for round in 1 2; do
        for st in 1 2 3; do
          echo "### round $round, GEMV_STAGES = $st" | tee -a "$OUT/pipe_bench.md"
          timeout "$(cap 60)" python3 tests/perf/with_switches.py "$Q.GEMV_STAGES=$st" \
            "$Q.PIPE_SM_TARGET=${PIPE_TARGET:-2048}" -- -m localllm.app.bench -m /tmp/q4km.gguf \
            -p 512 -n 128 -r 3 --device cuda 2>/tmp/pipeb.err \
            | grep -E "pp512|tg128" | tee -a "$OUT/pipe_bench.md"
          tail -2 /tmp/pipeb.err
        done
      done
      { echo "## pipe"; grep -sE "^best" "$OUT/pipe.md"; cat "$OUT/pipe_bench.md"; } \
        >>"$OUT/summary.md" ;;
    tests2) gpu_tests pytest2.log 200 tests/kernels/test_linear_half.py \
        tests/kernels/test_quant_gpu.py tests/media/test_vision_gpu_gemma3_llava.py ;;
  esac
done
echo "done at ${SECONDS}s" | tee -a "$OUT/summary.md"
cat "$OUT/summary.md"
