#!/usr/bin/env bash
# One device call: build llama.cpp's llama-bench, llama-server, llama-batched-bench and
# llama-mtmd-cli (CUDA, sm_90) from the tree `h200_prepare.sh` exports to .refbuild/llama.cpp, and
# hand the binaries back in 15 MB parts ($OUT/llb.part.*) to carry later as .llb (the machine
# keeps nothing between calls). Meanwhile the GPU tests named by $TESTS run. The export needs
# tools/server, tools/ui, tools/mtmd, tools/batched-bench and scripts/ui-assets.cmake (llama-server's
# UI target reads it even with LLAMA_BUILD_UI=OFF). Unpack: cat .llb/llb.part.* | xz -d | tar x.
set -u
OUT=${OUT:-/tmp/out}
# what to build (fewer targets: a shorter call)
TARGETS=${TARGETS:-llama-bench llama-server llama-batched-bench llama-mtmd-cli}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
date -u
(cmake -S .refbuild/llama.cpp -B /tmp/llb -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF \
  >/tmp/build.log 2>&1 &&
  cmake --build /tmp/llb -j 16 --target $TARGETS >>/tmp/build.log 2>&1) &
BLD=$!
if [ -n "${TESTS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  ln -sfn "$PWD" /tmp/site/localllm
  PYTHONSAFEPATH=1 PYTHONPATH=/tmp/site:$PWD timeout 300 python3 -m pytest -q -m gpu \
    -p no:cacheprovider $TESTS 2>&1 | tee "$OUT/pytest.log" | grep -v "^\." | tail -20
fi
wait $BLD || { tail -30 /tmp/build.log; exit 1; }
date -u
ls /tmp/llb/bin
(cd /tmp/llb && tar c bin | xz -T16 -6 | split -b 15M - "$OUT/llb.part.")
ls -la "$OUT"
