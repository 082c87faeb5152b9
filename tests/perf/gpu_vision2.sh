#!/usr/bin/env bash
# One device call (< 5 min on an H100/H200), issue 35 part 2: does the text side of a Qwen2.5-VL
# image prompt use CUDA graphs? The prompt steps that carry an image (spliced embeddings, 3-axis
# M-RoPE positions) run eagerly; every decode step after them must replay a decode graph
# (tests/media/test_vision_qwen25vl_graphs_gpu.py counts them, with and without decode-ahead,
# tokens checked against transformers). Then the other vision GPU tests (Qwen2.5-VL, Qwen3-VL,
# SmolVLM, Gemma 3, LLaVA) and the decode speed after an image prompt against after a text prompt
# of the same length (bench_vision_decode.py). $OUT collects pytest.log and decode.md.
# Prepare here first (git-excluded, carried; .whlvis kept apart so .whl stays small for others):
#   bash tests/perf/h200_prepare.sh      # .whl: gguf, llguidance (the image lacks them)
#   python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 -d .whlvis av pillow
#   grep -qx /.whlvis/ .git/info/exclude || echo /.whlvis/ >> .git/info/exclude
# then run it with carry [".whl", ".whlvis"] (~44 MiB):  bash tests/perf/gpu_vision2.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl/*.whl .whlvis/*.whl
ln -sfn "$PWD" /tmp/site/localllm
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, av, PIL; print('torch', torch.__version__, 'triton', triton.__version__, 'av', av.__version__)"
date -u
timeout "${TEST_T:-120}" python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/media/test_vision_qwen25vl_graphs_gpu.py 2>&1 | tee "$OUT/pytest.log" | tail -15
date -u
timeout "${TEST_T2:-150}" python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/media/test_vision_qwen25vl_gpu.py tests/media/test_vision_qwen3vl_gpu.py \
  tests/media/test_vision_gpu.py tests/media/test_vision_gpu_gemma3_llava.py 2>&1 \
  | tee -a "$OUT/pytest.log" | tail -15
date -u
timeout 60 python3 tests/perf/bench_vision_decode.py --device cuda -n 256 -r 3 2>&1 \
  | tee "$OUT/decode.md" | tail -8
date -u
