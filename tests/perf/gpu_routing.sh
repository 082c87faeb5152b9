#!/usr/bin/env bash
# One device call (issue 39, part 2): MoE offload decode under the router of a random-weight model
# and under drawn routing (`bench --routing model,uniform,zipf:1`), with expert-cache hit rates and
# bytes read, beside llama.cpp's llama-bench on the same file in the same call (llama-bench feeds a
# random token per step, as our bench now does by default). The file: the Qwen3-30B-A3B shape cut to
# $LAYERS layers (24: half the experts' bytes, so the budgets below are half of issue 7's).
# STEPS picks rows (default "budget llama disk"; also budget-split, ncmoe, cpumoe, llama-cpumoe,
# resident); BUDGET (5GiB), ROUTINGS (model,uniform,zipf:1), NCMOE_HC / CPUMOE_HC (the
# --host-compute modes of the ncmoe / cpumoe rows: "mapped host split" / "auto host split").
# Carry .whl, .refbuild/smollm2-tok.gguf and .llb (tests/perf/gpu_build_llamacpp.sh makes .llb), or
# run it after gpu_build_llamacpp.sh in the same call (carry .refbuild/llama.cpp instead of .llb);
# with LLB_PARTS=.serve2 it takes serve2_prepare.sh's smaller parts (carry .serve2 instead).
set -u
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
OUT=${OUT:-/tmp/out}
LAYERS=${LAYERS:-24}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
ln -sfn "$PWD" /tmp/site/localllm
export PYTHONPATH=/tmp/site:$PWD
# A build made earlier in the same call (gpu_build_llamacpp.sh) is used as it is.
[ -x /tmp/llb/bin/llama-bench ] || { mkdir -p /tmp/llb && cat ${LLB_PARTS:-.llb}/llb.part.* | xz -d | tar x -C /tmp/llb; }
export LD_LIBRARY_PATH=/tmp/llb/bin:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
date -u
M=/tmp/moe$LAYERS.gguf
[ -f $M ] || python3 tests/perf/make_synthetic.py --shape qwen3moe-30b-a3b --layers "$LAYERS" \
  --quant Q4_K_M -o $M --tokenizer-from .refbuild/smollm2-tok.gguf | tail -1
date -u
# each run's peak device memory, the whole process (CUDA context included): nvidia-smi every 100 ms
peak() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 >/tmp/smi.txt &
  local p=$!; "$@"; kill $p; echo "nvidia-smi peak: $(sort -n /tmp/smi.txt | tail -1) MiB"; }
ours() { echo "== ours $*"; peak timeout 240 python3 -m localllm.app.bench -m $M --device cuda -p 0 \
  "$@" 2>&1 | grep -E "qwen3moe|expert|routing|graphs|memory|rror|peak|  (budget|device|KV|scratch|runtime|planned)"; }
llama() { echo "== llama.cpp $*"; peak timeout 120 /tmp/llb/bin/llama-bench -m $M -ngl 99 -fa 1 -p 0 \
  "$@" 2>&1 | grep -E "^\| q|error|peak"; }
R=${ROUTINGS:-model,uniform,zipf:1}
H=$((LAYERS / 2))
for step in ${STEPS:-budget llama disk}; do
  case $step in
    # (--show-plan prints the plan and exits: a run of its own before the timed one)
    budget) ours --mem-budget ${BUDGET:-5GiB} --show-plan
      ours -n 32 -r 2 --mem-budget ${BUDGET:-5GiB} --routing $R ;;
    budget-split) ours --mem-budget ${BUDGET:-5GiB} --host-compute split --show-plan
      ours -n 32 -r 2 --mem-budget ${BUDGET:-5GiB} --host-compute split --routing $R ;;
    llama) llama -n 32 -r 2 -ncmoe $H ;;
    # llama.cpp's static split, ours the same layers: GPU reads them mapped, the CPU computes them,
    # or the two share them
    ncmoe) for hc in ${NCMOE_HC:-mapped host split}; do
        ours -n 32 -r 2 --n-cpu-moe $H --host-compute $hc --routing $R; done ;;
    cpumoe) for hc in ${CPUMOE_HC:-auto host split}; do
        ours -n 32 -r 2 --cpu-moe --host-compute $hc --routing $R; done ;;
    llama-cpumoe) llama -n 32 -r 2 -ot exps=CPU ;;
    disk) ours -n 32 -r 2 --experts disk --expert-slots $((LAYERS * 64)) --routing $R ;;
    resident) ours -n 64 -r 2 --routing model,uniform; llama -n 64 -r 2 ;;
  esac 2>&1 | tee -a "$OUT/routing.md"
done
date -u
