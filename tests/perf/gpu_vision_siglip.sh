#!/usr/bin/env bash
# One device call (~6-8 minutes on an H100/H200; issues 35 + 38): F16/BF16 weights multiplied in
# their own dtype on tensor cores (`half_gemm`, kernels/quant/linear_half.py; the switch
# `kernels.quant.linear.HALF_GEMM`) and the SigLIP blocks in float16 on CUDA
# (`siglip.Tower.use_half`; the switch `media.vision.mmproj.HALF_TOWER`) — both off as shipped
# until this run shows them — against the float32 row tiles shipped (Gemma-3-4B tower 171 ms against llama.cpp's 145 on an H100,
# tests/perf/results/vision.md, 2026-12-06 12:15 UTC). Steps (STEPS, in order):
#   tests  pytest -m gpu: half_gemm against float32 and the rounded-input reference (F16 2e-3,
#          BF16 1e-2; FusedLinear, a CUDA graph replay, saturated F16 inputs), the generic CUDA
#          linears, Gemma 3 / LLaVA / SmolVLM encoders and greedy tokens against transformers
#          (2e-2; the half tower float16 / bfloat16 / float32 blocks), the converted F16 text
#          families' logits (0.02) and greedy tokens on CUDA (the Qwen-VL GPU tests need PyAV,
#          which this carry lacks: tests/perf/gpu_vision2.sh runs them)
#   parts  tests/perf/bench_siglip_parts.py --profile: the 27-block tower as float32 tiles
#          (before), with TF32, half_gemm linears in float32 blocks, half blocks (float16: the
#          new default; bfloat16); the largest linear inputs (float16's range); ffn_up and
#          attention alone; the top CUDA kernels of the default
#   mtmd   tests/perf/gpu_vision_mtmd.sh for the Gemma-3-4B shape: encode and TTFT next to
#          llama.cpp's libmtmd (the tower in its new CUDA default), leaving 70 s for f16
#   f16    an F16 SmolLM2-135M-shape text file (make_synthetic.py --quant F16): `localllm bench`
#          pp512 / tg128 with half_gemm, the same with the float32 tiles of before (tg32), and
#          llama-bench -fa 1 -ngl 99 on the same file
#   tests2 the other GPU tests on F16 fixtures (hybrid families, Qwen3-Next, LoRA) where time is
#          left (rarely in the default call: `STEPS=tests2` runs them alone, ~1-2 minutes)
# $OUT: pytest.log, siglip_parts.md, f16_*.md, mtmd/ (gpu_vision_mtmd.sh's files), summary.md
# (compact, printed last).
# Carry [".vismtmd"] (the gguf and llguidance wheels, llama.cpp 3f545bec's CUDA libs and bins
# incl. llama-bench, its headers: gpu_vision_mtmd.sh's header says how that folder is made; plus
# `ln -f .serve2/smollm2-tok.gguf .vismtmd/`, the tokenizer the F16 file copies; ~27 MiB, with
# the ~24 MiB tree ~51 MiB), from the repo root:
#   bash tests/perf/gpu_vision_siglip.sh        carry [".vismtmd"]        (timeout_s 600)
# Knobs: STEPS ("tests parts mtmd f16 tests2"), END_S (540: nothing starts after it, each step's timeout
# ends by then).
set -u
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
export OUT=${OUT:-/tmp/out}
STEPS=${STEPS-tests parts mtmd f16 tests2}
END_S=${END_S:-540}
export LLB=${LLB:-/tmp/llb}
C=.vismtmd
F16=/tmp/smollm2-135m-f16.gguf
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $C/*.whl
ln -sfn "$PWD" /tmp/site/localllm
export PYTHONPATH=/tmp/site:$PWD
[ -x $LLB/bin/llama-bench ] || { mkdir -p $LLB && cat $C/llb.part.* | xz -d | tar x -C $LLB; }
export LD_LIBRARY_PATH=$LLB/bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git log -1 --format='commit %h %s' 2>/dev/null; date -u; } | tee "$OUT/machine.txt"
# the F16 file meanwhile (~270 MB, a few seconds)
GEN=
case " $STEPS " in *" f16 "*)
  (python3 tests/perf/make_synthetic.py --shape smollm2-135m --quant F16 --text-head \
    --tokenizer-from $C/smollm2-tok.gguf -o $F16 >"$OUT/make_f16.log" 2>&1 && touch $F16.done) &
  GEN=$! ;;
esac
cap() { local t=$((END_S - SECONDS)); [ "$t" -lt "$1" ] || t=$1; [ "$t" -gt 5 ] || t=5; echo $t; }
left() { [ $((END_S - SECONDS)) -gt "$1" ] || { echo "skip $2: ${SECONDS}s used of END_S=$END_S"; return 1; }; }
bench() {  # LABEL BEFORE(0/1) ARGS...: localllm bench on the F16 file
  local label=$1 before=$2; shift 2
  timeout "$(cap 90)" python3 -c "
import sys
import localllm.kernels.quant.linear as L
# 1: the CUDA policy as shipped (F16/BF16 in float32 row tiles per call); 0: half_gemm on
L.HALF_GEMM = sys.argv.pop(1) == '0'
from localllm.app.bench import main
sys.exit(main(sys.argv[1:]))" $before -m $F16 --device cuda "$@" 2>&1 | tee "$OUT/f16_$label.md" \
    | grep -E "^\||rror"
}
for step in $STEPS; do
  echo "== $step at ${SECONDS}s"
  case $step in
    tests) left 60 tests || continue
      timeout "$(cap 200)" python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/kernels/test_linear_half.py tests/kernels/test_quant_gpu.py \
        tests/engine/test_fused_linear.py tests/media/test_vision_gpu_gemma3_llava.py \
        tests/media/test_vision_gpu.py tests/engine/test_converted_families_gpu.py 2>&1 | tee "$OUT/pytest.log" \
        | grep -v "^\." | tail -12 ;;
    tests2) left 60 tests2 || continue
      timeout "$(cap 200)" python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/engine/test_hybrid_families_gpu.py tests/engine/test_qwen3next_gpu.py \
        tests/lora/test_lora_gpu.py 2>&1 | tee "$OUT/pytest2.log" | grep -v "^\." | tail -12 ;;
    parts) left 60 parts || continue
      timeout "$(cap 150)" python3 tests/perf/bench_siglip_parts.py --device cuda -r 5 --profile \
        2>"$OUT/siglip_parts.err" | tee "$OUT/siglip_parts.md"
      tail -3 "$OUT/siglip_parts.err" ;;
    f16) left 50 f16 || continue
      [ -z "$GEN" ] || wait $GEN; [ -f $F16.done ] || { tail -3 "$OUT/make_f16.log"; continue; }
      bench half 0 -p 512 -n 128 -r 3
      bench before 1 -p 512 -n 32 -r 1
      timeout "$(cap 60)" $LLB/bin/llama-bench -m $F16 -p 512 -n 128 -r 3 -fa 1 -ngl 99 -o md \
        2>&1 | tee "$OUT/f16_llama.md" | grep -E "^\||rror|No such" ;;
    mtmd) left 150 mtmd || continue
      OUT=$OUT/mtmd SHAPES=gemma3-4b NO_INSTALL=1 END_S=$((END_S - SECONDS - 70)) \
        HALF_TOWER=${HALF_TOWER:-float16} \
        bash tests/perf/gpu_vision_mtmd.sh 2>&1 | tail -12 ;;
  esac
done
{ echo "# gpu_vision_siglip $(date -u +%FT%TZ) on $(head -1 "$OUT/machine.txt")"
  echo; echo "## tests"
  for log in pytest pytest2; do
    [ -f "$OUT/$log.log" ] || continue
    pat="^(FAILED|ERROR)|[0-9]+ (passed|failed|skipped|errors?)"
    if grep -qE "$pat" "$OUT/$log.log"; then grep -E "$pat" "$OUT/$log.log" | tail -8
    else echo "$log cut short: $(tail -c 200 "$OUT/$log.log")"; fi
  done
  echo; echo "## SigLIP so400m tower (896 px, 27 blocks)"
  grep -E "^\| (float32|half_gemm|use_half|attn_|ffn_)" "$OUT/siglip_parts.md" 2>/dev/null
  echo; echo "## F16 SmolLM2-135M shape: ours (half_gemm), ours before (float32 tiles), llama.cpp"
  for f in half before llama; do grep -E "^\| .*(pp|tg)[0-9]" "$OUT/f16_$f.md" 2>/dev/null | sed "s/^/$f /"; done
  echo; echo "## Gemma-3-4B shape next to libmtmd"
  grep -E "^(\||img[0-9]+\.png|(ours|mtmd_ttft) loaded|ours / llama|mtmd_ttft failed)" \
    "$OUT/mtmd/vision_mtmd_gemma3-4b.md" 2>/dev/null
} >"$OUT/summary.md"
cat "$OUT/summary.md"
echo "done at ${SECONDS}s"
