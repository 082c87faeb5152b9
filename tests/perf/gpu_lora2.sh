#!/usr/bin/env bash
# One device call (~5 min on an H100/H200), issue 36: the LoRA GPU tests (tests/lora/test_lora_gpu.py,
# the triton shrink/expand kernels against their torch reference in tests/kernels/test_lora_kernels.py)
# and MoE residency of a Hugging Face folder on CUDA (tests/engine/test_hf_moe_residency_gpu.py),
# then decode with 0, 1 and 4 rank-16 adapters on the Llama-3-8B-shaped Q4_K_M, ours (`localllm
# bench`, the triton LoRA kernels) next to llama.cpp's CUDA build with the very same GGUF LoRA files
# (tests/perf/bench_llamacpp_lora.py: a small C program on its libllama, llama_adapter_lora_init +
# llama_set_adapters_lora, built here against the carried headers), cases alternated. Last, one
# llama-server request on the same random-weight model, its answer kept: the HTTP 500 of the
# earlier run (llama-server's output parser rejects a random model's malformed UTF-8; no LoRA involved).
# Prepare here first: `bash tests/perf/h200_prepare.sh` (.whl, .refbuild/smollm2-tok.gguf, and the
# llama.cpp tree in .refbuild/llama.cpp for its headers) and the CUDA build in .llb
# (gpu_build_llamacpp.sh); carry [".whl", ".refbuild/smollm2-tok.gguf", ".llb",
# ".refbuild/llama.cpp/include", ".refbuild/llama.cpp/ggml/include"].
# $OUT collects pytest.log, compare.md, compare.err, server.json and llama-server.log.
set -u
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
ln -sfn "$PWD" /tmp/site/localllm
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import llguidance, gguf" || { echo "carry .whl with llguidance and gguf"; exit 1; }
[ -f .refbuild/llama.cpp/include/llama.h ] || { echo "carry .refbuild/llama.cpp/include"; exit 1; }
[ -d .llb ] || { echo "carry .llb (gpu_build_llamacpp.sh)"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
date -u
mkdir -p /tmp/llb && cat .llb/llb.part.* | xz -d | tar x -C /tmp/llb
python3 tests/perf/make_synthetic.py --shape llama3-8b --quant Q4_K_M -o /tmp/q4km.gguf \
  --tokenizer-from .refbuild/smollm2-tok.gguf >/tmp/make.log 2>&1 &
GEN=$!
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/lora/test_lora_gpu.py \
  tests/kernels/test_lora_kernels.py tests/engine/test_hf_moe_residency_gpu.py 2>&1 \
  | tee "$OUT/pytest.log" | grep -v "^\." | tail -25
wait $GEN || { tail -5 /tmp/make.log; exit 1; }
date -u
# llama.cpp's adapter format, f32 A and B (what convert_lora_to_gguf.py writes; both engines read it)
python3 tests/perf/bench_lora.py make --model /tmp/q4km.gguf --out /tmp/loras --rank 16 --count 4
LD_LIBRARY_PATH=/tmp/llb/bin timeout 240 python3 tests/perf/bench_llamacpp_lora.py run --model /tmp/q4km.gguf --dir /tmp/loras \
  --llama-cpp .refbuild/llama.cpp --lib /tmp/llb/bin --device cuda -n 128 --reps 3 --rounds 1 \
  >"$OUT/compare.md" 2>"$OUT/compare.err"
cat "$OUT/compare.md"; tail -3 "$OUT/compare.err"
date -u
# the earlier HTTP 500, its body kept: one plain /completion, no adapter
LD_LIBRARY_PATH=/tmp/llb/bin /tmp/llb/bin/llama-server -m /tmp/q4km.gguf -ngl 99 -c 512 -np 1 \
  --port 8392 >"$OUT/llama-server.log" 2>&1 &
SRV=$!
timeout 60 python3 - "$OUT/server.json" <<'EOF'
import json, sys, time, urllib.error, urllib.request
url = "http://127.0.0.1:8392"
for _ in range(100):
    try:
        urllib.request.urlopen(url + "/health", timeout=1)
        break
    except OSError:
        time.sleep(0.5)
body = {"prompt": "The capital of France is", "n_predict": 64, "temperature": 0,
        "ignore_eos": True, "cache_prompt": False}
req = urllib.request.Request(url + "/completion", json.dumps(body).encode(),
                             {"Content-Type": "application/json"})
try:
    with urllib.request.urlopen(req, timeout=50) as r:
        ans = {"status": r.status, "body": json.loads(r.read())}
except urllib.error.HTTPError as e:
    ans = {"status": e.code, "body": e.read().decode(errors="replace")[:2000]}
open(sys.argv[1], "w").write(json.dumps(ans, indent=1))
print("llama-server /completion:", ans["status"], str(ans["body"])[:300])
EOF
kill $SRV 2>/dev/null; wait $SRV 2>/dev/null
grep -iE "unparsed|error" "$OUT/llama-server.log" | tail -3
date -u
