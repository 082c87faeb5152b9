#!/usr/bin/env bash
# Prepare, on the development machine, the one carried folder `.serve2/` that gpu_serve2.sh needs
# (git-excluded; the device call's carry limit is 64 MiB with the tracked tree, ~23 MiB, inside):
#   .serve2/llb.part.*        llama-server, llama-bench, llama-batched-bench and their libraries
#                             from .llb (gpu_build_llamacpp.sh's build of llama.cpp 3f545bec),
#                             stripped, libggml-cuda's PTX dropped (prune_fatbin.py: the sm_90
#                             cubins stay byte for byte), xz -9e: ~22 MiB instead of 43
#   .serve2/whl/*.whl         gguf, llguidance (.whl) and the server's stack the device image
#                             lacks (fastapi, starlette, pydantic, uvicorn, uvloop, httptools, ...;
#                             from .whlserve)
#   .serve2/smollm2-tok.gguf  the tokenizer the synthetic files copy (.refbuild/smollm2-tok.gguf)
# Needs .llb, .whl, .whlserve and .refbuild/smollm2-tok.gguf (h200_prepare.sh with SERVE=1, and
# gpu_build_llamacpp.sh's parts in .llb). Run from the repo root: bash tests/perf/serve2_prepare.sh
set -euo pipefail
grep -qx "/.serve2/" .git/info/exclude || echo "/.serve2/" >>.git/info/exclude
for p in .llb/llb.part.aa .whl .whlserve .refbuild/smollm2-tok.gguf; do
  [ -e "$p" ] || { echo "serve2_prepare: $p missing (see this script's header)"; exit 1; }
done
rm -rf .serve2 && mkdir -p .serve2/whl
tmp=$(mktemp -d)
cat .llb/llb.part.* | xz -d | tar x -C "$tmp"
cd "$tmp"
files="bin/llama-server bin/llama-bench bin/llama-batched-bench"
for f in bin/*.so*; do case $f in *mtmd-cli*) ;; *) files="$files $f" ;; esac; done
for f in $files; do [ -L "$f" ] || strip --strip-unneeded "$f"; done
python3 "$OLDPWD/tests/perf/prune_fatbin.py" bin/libggml-cuda.so.0.*[0-9]
tar c $files | xz -T2 -9e | split -b 15M - "$OLDPWD/.serve2/llb.part."
cd "$OLDPWD" && rm -rf "$tmp"
cp .whl/*.whl .serve2/whl/
for n in annotated_doc annotated_types anyio fastapi h11 pydantic pydantic_core python_multipart \
  opentelemetry_api starlette typing_extensions typing_inspection uvicorn uvloop httptools; do
  cp .whlserve/"$n"-[0-9]*.whl .serve2/whl/
done
cp .refbuild/smollm2-tok.gguf .serve2/
du -sh .serve2 && ls .serve2 .serve2/whl
