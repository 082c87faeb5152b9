#!/usr/bin/env bash
# One device call (issue 39, part 2): MoE offload decode under the router of a random-weight model
# and under drawn routing (`bench --routing model,uniform,zipf:1`), with expert-cache hit rates and
# bytes read, beside llama.cpp's llama-bench on the same file in the same call (llama-bench feeds a
# random token per step, as our bench now does by default). The file: the Qwen3-30B-A3B shape cut to
# $LAYERS layers (24: half the experts' bytes, so the budgets below are half of issue 7's).
# Carry .whl, .refbuild/smollm2-tok.gguf and .llb (tests/perf/gpu_build_llamacpp.sh makes .llb).
set -u
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
OUT=${OUT:-/tmp/out}
LAYERS=${LAYERS:-24}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
ln -sfn "$PWD" /tmp/site/localllm
export PYTHONPATH=/tmp/site:$PWD
mkdir -p /tmp/llb && cat .llb/llb.part.* | xz -d | tar x -C /tmp/llb
export LD_LIBRARY_PATH=/tmp/llb/bin:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
date -u
M=/tmp/moe$LAYERS.gguf
[ -f $M ] || python3 tests/perf/make_synthetic.py --shape qwen3moe-30b-a3b --layers "$LAYERS" \
  --quant Q4_K_M -o $M --tokenizer-from .refbuild/smollm2-tok.gguf | tail -1
date -u
ours() { echo "== ours $*"; timeout 240 python3 -m localllm.app.bench -m $M --device cuda -p 0 "$@" \
  2>&1 | grep -E "qwen3moe|expert|routing|graphs|memory|rror"; }
llama() { echo "== llama.cpp $*"; timeout 120 /tmp/llb/bin/llama-bench -m $M -ngl 99 -fa 1 -p 0 "$@" \
  2>&1 | grep -E "^\| q|error"; }
R=${ROUTINGS:-model,uniform,zipf:1}
ours -n 32 -r 2 --mem-budget ${BUDGET:-5GiB} --routing $R | tee -a "$OUT/routing.md"
llama -n 32 -r 2 -ncmoe $((LAYERS / 2)) | tee -a "$OUT/routing.md"
ours -n 32 -r 2 --experts disk --expert-slots $((LAYERS * 64)) --routing $R | tee -a "$OUT/routing.md"
[ -n "${RESIDENT:-}" ] && { ours -n 64 -r 2 --routing model,uniform | tee -a "$OUT/routing.md";
  llama -n 64 -r 2 | tee -a "$OUT/routing.md"; }
date -u
