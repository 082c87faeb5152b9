#!/usr/bin/env bash
# One device call (~4-5 minutes on an H100/H200): why a Gemma-3-4B-shaped SigLIP tower encodes
# slower than llama.cpp's (171 against 145 ms on an H100, tests/perf/results/vision.md,
# 2026-12-06 12:15 UTC), and whether the opt-in half tower (`siglip.Tower.use_half`: the blocks'
# matmuls on tensor cores, attention through flash SDPA; residual stream and norms float32)
# closes the gap without leaving the accuracy bound:
#   1. pytest -m gpu: Gemma 3 / LLaVA encoders on CUDA against transformers' records, and the
#      half tower (float16, bfloat16) within the same 2e-2 (tests/media/test_vision_gpu_gemma3_llava.py)
#   2. tests/perf/bench_siglip_parts.py --profile: the 27-block tower as shipped, with TF32, and
#      half; ffn_up and attention alone per dtype and SDPA backend; the top CUDA kernels
#   3. tests/perf/gpu_vision_mtmd.sh for the Gemma shape with HALF_TOWER=float16: encode and TTFT
#      next to llama.cpp's libmtmd with the half tower (the as-shipped run is the 12:15 one;
#      step 2 compares shipped and half in this call)
# $OUT: pytest.log, siglip_parts.md, and gpu_vision_mtmd.sh's summary.md / vision_mtmd_gemma3-4b.*.
# Carry [".vismtmd"] (the gguf and llguidance wheels and llama.cpp's libs: gpu_vision_mtmd.sh's
# header says how that folder is made), from the repo root:
#   bash tests/perf/gpu_vision_siglip.sh        carry [".vismtmd"]        (timeout_s 600)
# Knobs: HALF_TOWER (float16), SKIP_MTMD=1 (steps 1-2 only, ~2 minutes).
set -u
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .vismtmd/*.whl
ln -sfn "$PWD" /tmp/site/localllm
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
date -u
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/media/test_vision_gpu_gemma3_llava.py \
  -k "encoder or half_tower" 2>&1 | tee "$OUT/pytest.log" | tail -8
date -u
timeout 150 python3 tests/perf/bench_siglip_parts.py --device cuda -r 5 --profile 2>"$OUT/siglip_parts.err" \
  | tee "$OUT/siglip_parts.md"
tail -3 "$OUT/siglip_parts.err"
date -u
if [ -z "${SKIP_MTMD:-}" ]; then
  left=$((570 - SECONDS))
  [ $left -gt 150 ] || { echo "skip the mtmd comparison: ${SECONDS}s used"; exit 0; }
  SHAPES=gemma3-4b HALF_TOWER=${HALF_TOWER:-float16} NO_INSTALL=1 END_S=$left \
    bash tests/perf/gpu_vision_mtmd.sh 2>&1 | tail -12
fi
echo "done at ${SECONDS}s"
