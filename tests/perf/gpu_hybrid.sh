#!/usr/bin/env bash
# One device call for the hybrid families (lfm2, granitehybrid): their GPU tests
# (tests/engine/test_hybrid_families_gpu.py: logits near transformers, engine greedy / batch /
# forks / preemption, Granite's experts off the device), then `localllm bench` pp512 / tg128 on
# real-shape random-weight Q4_K_M files (LFM2-1.2B, Granite-4.0-H-Tiny) made on the device by
# tests/perf/make_hybrid_synthetic.py. Under ~5 minutes on an H100/H200.
#
# Prepare here first: `bash tests/perf/h200_prepare.sh` (.whl: gguf; .refbuild/smollm2-tok.gguf),
# then run from the repo root on the device, carrying [".whl", ".refbuild/smollm2-tok.gguf"]
# (and ".llb", llama.cpp's CUDA build from gpu_build_llamacpp.sh, for llama-bench beside ours):
#   bash tests/perf/gpu_hybrid.sh        # $OUT collects pytest.log and bench.md
set -u
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
ln -sfn "$PWD" /tmp/site/localllm
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/bench.md"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
date -u
TOK=.refbuild/smollm2-tok.gguf
( python3 tests/perf/make_hybrid_synthetic.py --shape lfm2-1.2b -o /tmp/lfm2.gguf --tokenizer-from $TOK \
  && python3 tests/perf/make_hybrid_synthetic.py --shape granite-4.0-h-tiny -o /tmp/g4t.gguf \
       --tokenizer-from $TOK ) >/tmp/make.log 2>&1 &
GEN=$!
timeout "${TEST_T:-180}" python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/engine/test_hybrid_families_gpu.py tests/kernels/test_recurrent_gpu.py 2>&1 \
  | tee "$OUT/pytest.log" | grep -v "^\." | tail -15
date -u
wait $GEN || { tail -5 /tmp/make.log; exit 1; }
cat /tmp/make.log
if [ -d .llb ]; then  # llama.cpp's CUDA llama-bench beside ours, same files, same call
  mkdir -p /tmp/llb && cat .llb/llb.part.* | xz -d | tar x -C /tmp/llb
fi
for f in /tmp/lfm2.gguf /tmp/g4t.gguf; do
  timeout 150 python3 -m localllm.app.bench -m "$f" -p 512 -n 128 -r 3 --device cuda 2>&1 \
    | tee -a "$OUT/bench.md" | grep -E "pp512|tg128|Error"
  if [ -x /tmp/llb/bin/llama-bench ]; then
    LD_LIBRARY_PATH=/tmp/llb/bin timeout 120 /tmp/llb/bin/llama-bench -m "$f" -p 512 -n 128 \
      -r 3 -ngl 99 2>&1 | tee -a "$OUT/bench.md" | grep -E "pp512|tg128|error"
  fi
done
date -u
