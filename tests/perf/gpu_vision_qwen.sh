#!/usr/bin/env bash
# One device call (~3 min on an H100/H200): the vision GPU tests (Qwen2.5-VL and Qwen3-VL through
# the runner's eager steps and shifted decode graphs; SmolVLM), then the encode time of a
# Qwen2.5-VL-7B-shaped tower on a 1024x1024 and a 448x448 image. $OUT collects pytest.log and
# vision.md. Prepare here first (git-excluded, carried):
#   bash tests/perf/h200_prepare.sh      # .whl: gguf, llguidance (the image lacks them)
#   python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 -d .whl av pillow
# then run it with carry [".whl"]:  bash tests/perf/gpu_vision_qwen.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
ln -sfn "$PWD" /tmp/site/localllm
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
date -u
timeout "${TEST_T:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/media/test_vision_qwen25vl_gpu.py tests/media/test_vision_qwen3vl_gpu.py \
  tests/media/test_vision_gpu.py 2>&1 \
  | tee "$OUT/pytest.log" | tail -15
date -u
for side in 1024 448; do
  timeout 120 python3 tests/perf/bench_vision_qwen.py --device cuda --side $side -r 5 2>&1 \
    | tee -a "$OUT/vision.md"
done
date -u
