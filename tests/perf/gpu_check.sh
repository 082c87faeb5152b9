#!/usr/bin/env bash
# One device call (<= 9.5 min on an H100/H200): the GPU tests of this session's untested GPU
# changes, then a decode / prompt check of the 8B Q4_K_M synthetic next to llama-bench in the same
# call (a regression guard for the changed decode GEMVs and prompt graphs, not a tuned benchmark).
#   tests   pytest -m gpu on TESTS (default below: half GEMMs, LoRA epilogues, packed GEMVs, prompt
#           graphs incl. hybrids, decode graphs, the Gemma 3 / LLaVA towers)
#   bench   `localllm bench -p 512 -n 128 -r 3` and `llama-bench -p 512 -n 128 -r 3 -fa 1 -ngl 99`
#           on a Llama-3.1-8B-shape Q4_K_M synthetic (written while the tests run)
# Carry [".serve2"] (wheels, llama.cpp's CUDA build, the tokenizer), from the repo root:
#   bash tests/perf/gpu_check.sh        (timeout_s 600)
# Knobs: STEPS ("tests bench"), TESTS, END_S (570).
set -u
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
STEPS=${STEPS:-tests bench}
END_S=${END_S:-570}
TESTS=${TESTS:-tests/kernels/test_linear_half.py tests/kernels/test_triton_packed.py \
tests/kernels/test_lora_epilogue.py tests/lora/test_lora_epilogue_gpu.py tests/kernels/test_lora_kernels.py \
tests/lora/test_lora_epilogue_module.py \
tests/engine/test_prefill_graphs.py tests/engine/test_hybrid_prompt_graphs.py tests/engine/test_gpu_graphs.py \
tests/media/test_vision_gpu_gemma3_llava.py tests/kernels/test_quant_gpu.py}
LLB=/tmp/llb
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .serve2/whl/gguf-*.whl .serve2/whl/llguidance-*.whl
[ -x $LLB/bin/llama-bench ] || { mkdir -p $LLB && cat .serve2/llb.part.* | xz -d | tar x -C $LLB; }
mkdir -p /tmp/site && ln -sfn "$PWD" /tmp/site/localllm
export PYTHONPATH=/tmp/site:$PWD
export LD_LIBRARY_PATH=$LLB/bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git log --oneline -1; date -u; } | tee "$OUT/machine.txt"
MODEL=/tmp/serve2-llama3-8b.gguf
TOK=.serve2/smollm2-tok.gguf
if [ ! -f "$MODEL.done" ]; then
  (python3 tests/perf/make_synthetic.py --shape llama3-8b --quant Q4_K_M -o "$MODEL" --text-head \
    --tokenizer-from "$TOK" >/tmp/make_check.log 2>&1 && touch "$MODEL.done") &
  GEN=$!
fi
cap() { local t=$((END_S - SECONDS)); [ "$t" -lt "$1" ] || t=$1; [ "$t" -gt 5 ] || t=5; echo $t; }
for step in $STEPS; do
  echo "== $step at ${SECONDS}s"
  case $step in
    tests) timeout "$(cap 300)" python3 -m pytest -q -m gpu -p no:cacheprovider -rf $TESTS 2>&1 \
        | tee "$OUT/pytest.log" | grep -v "^\." | tail -30 ;;
    bench) [ -z "${GEN:-}" ] || wait $GEN
      [ -f "$MODEL.done" ] || { tail -3 /tmp/make_check.log; continue; }
      timeout "$(cap 150)" python3 -m localllm.app bench -m "$MODEL" --device cuda -p 512 -n 128 -r 3 \
        2>&1 | tee "$OUT/bench_ours.md" | grep -E "^\||rror"
      timeout "$(cap 120)" $LLB/bin/llama-bench -m "$MODEL" -p 512 -n 128 -r 3 -fa 1 -ngl 99 -o md \
        2>&1 | tee "$OUT/bench_llama.md" | grep -E "^\||rror" ;;
  esac
done
echo "done at ${SECONDS}s"
