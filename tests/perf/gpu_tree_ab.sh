#!/usr/bin/env bash
# One device call: the GPU tests of this tree, then `localllm bench` of an older tree (exported to
# .ab) and this one, alternating, on the Llama-3-8B-shaped Q4_K_M (behaviour and speed unchanged
# across a refactor). Prepare here first: `bash tests/perf/h200_prepare.sh` (.whl, the tokenizer)
# and `git archive REV app engine kernels offload media | tar x -C .ab`; carry .whl, .refbuild and
# .ab. $OUT collects pytest.log and ab.md.
set -u
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
ln -sfn "$PWD" /tmp/site/localllm
mkdir -p /tmp/absite && ln -sfn "$PWD/.ab" /tmp/absite/localllm
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
date -u
python3 tests/perf/make_synthetic.py --shape llama3-8b --quant Q4_K_M -o /tmp/q4km.gguf \
  --tokenizer-from .refbuild/smollm2-tok.gguf >/tmp/make.log 2>&1 &
GEN=$!
timeout "${TEST_T:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider ${TESTS:-tests} 2>&1 \
  | tee "$OUT/pytest.log" | grep -v "^\." | tail -15
date -u
wait $GEN || { tail -5 /tmp/make.log; exit 1; }
for round in $(seq "${ROUNDS:-2}"); do
  for tree in old new; do
    pp=/tmp/site:$PWD; [ $tree = old ] && pp=/tmp/absite:/tmp/site
    echo "round $round $tree" | tee -a "$OUT/ab.md"
    PYTHONPATH=$pp timeout 150 python3 -m localllm.app.bench -m /tmp/q4km.gguf -p 512 -n 128 \
      -r 3 --device cuda 2>&1 | tee -a "$OUT/ab.md" | grep -E "pp512|tg128|Error"
  done
done
date -u
