#!/usr/bin/env bash
# One device call (~1-2 min), CPU only (issue 39): the CPU prompt attention kernel
# (kernels/cpu/prompt_attention.c) on the GPU machine's cores, another CPU than the development
# box's: its tests (float64 reference, bit invariance over chunks, tile places, neighbours and
# 1 vs 2 threads) and those of the paths around it, then one 512-row layer call of the
# Llama-3.2-1B attention shape in each mode (tiled / rows / sdpa) at 16, 8 and 2 threads.
# Needs nothing carried beyond the tree (torch from the machine; no model files; --noconftest:
# these tests use no fixtures, and the conftests import gguf, which the machine may lack).
#   bash tests/perf/gpu_prompt_attention.sh
# $OUT gets pytest.log and attention.md; the summary is printed.
set -u
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/site
ln -sfn "$PWD" /tmp/site/localllm
export PYTHONPATH=/tmp/site:$PWD
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores:$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
python3 -c "import torch; print('torch', torch.__version__)"
OMP_NUM_THREADS=1 timeout "${TEST_T:-240}" python3 -m pytest -q -p no:cacheprovider --noconftest \
  tests/kernels/test_cpu_prompt_attention.py tests/kernels/test_cpu_paged_decode.py 2>&1 \
  | tee "$OUT/pytest.log" | tail -3
timeout "${BENCH_T:-240}" python3 tests/perf/bench_prompt_attention.py --threads 16 8 2 \
  --rounds "${ROUNDS:-5}" 2>&1 | tee "$OUT/attention.md"
date -u
