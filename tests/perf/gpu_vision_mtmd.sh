#!/usr/bin/env bash
# One device call (about 5-7 minutes on an H100/H200; issue 35's last measurement): image encode
# time and image-prompt time to first token, localllm (--device cuda) next to llama.cpp's libmtmd
# (3f545bec, CUDA: every layer on the GPU, flash attention "auto" as in llama-mtmd-cli: on where
# supported, the summary says what it became; mtmd-cli's n_batch 2048 / n_ubatch 512) on the same random-weight real-shape pairs (tests/perf/make_synthetic_vlm_big.py):
#   gemma3-4b    Gemma-3-4B text (Q4_K_M, 34 x 2560) + SigLIP so400m mmproj (F16, 27 x 1152),
#                an 896x896 PNG: 256 image tokens
#   qwen25vl-7b  Qwen2.5-VL-7B text (Q4_K_M, 28 x 3584) + its ViT mmproj (F16, 32 x 1280, window
#                attention, merger to 3584), a 1024x1024 PNG: smart-resized to 1036x1036 (74 x 74
#                patches), 1,369 image tokens
# llama.cpp is timed through tests/perf/mtmd_ttft.c (what llama-mtmd-cli does for one image
# prompt, in one process: compiled here against the carried libmtmd), rounds alternating with
# ours in tests/perf/bench_vision_vs_mtmd.py (--llama-driver), warm-up rounds dropped, ours with
# a fresh image hash each round (no encoder or prefix cache hit). Threads 8 (preprocessing and
# tokenizing run on the CPU in both). $OUT: summary.md, vision_mtmd_<shape>.md / .json, make.log.
#
# Prepare once on the development machine (git-excluded folder .vismtmd, ~26 MiB; with the ~25
# MiB tree well under the 64 MiB carry; made on 2026-12-06 in /work/main):
#   echo /.vismtmd/ >>.git/info/exclude; mkdir -p .vismtmd
#   ln -f .serve2/llb.part.* .vismtmd/     # llama.cpp 3f545bec CUDA libs (libmtmd, libllama,
#                                          # libggml*), xz parts: tests/perf/serve2_prepare.sh
#   cp .serve2/whl/gguf-*.whl .serve2/whl/llguidance-*.whl .vismtmd/
#   S=/work/llama-cpu-src; tar c -C $S include/llama.h include/llama-cpp.h ggml/include \
#     tools/mtmd/mtmd.h tools/mtmd/mtmd-helper.h | xz -9 >.vismtmd/mtmd-include.tar.xz
# (the same headers as .refbuild/llama.cpp's). Then the device call, from the repo root:
#   bash tests/perf/gpu_vision_mtmd.sh        carry [".vismtmd"]        (timeout_s 600)
# Knobs: SHAPES ("gemma3-4b qwen25vl-7b"), ROUNDS (5), THREADS (8), END_S (470: no bench runs
# past this many seconds; each bench gets at most 200 s, the file writers 180 s), HALF_TOWER
# (unset: the CUDA default, Gemma 3's SigLIP blocks in the F16 file's float16; float16, bfloat16
# or float32 override it, `siglip.Tower.use_half`). A dry run on a
# CPU against a CPU build of llama.cpp (its bin/ under LLB, headers in MTMD_SRC), small files:
#   PYTHONPATH=/work NO_INSTALL=1 DEVICE=cpu THREADS=2 ROUNDS=1 LLB=/work/llama-cpu/build MTMD_SRC=/work/llama-cpu-src \
#   SHAPES=qwen25vl-7b SIDE=224 MAKE_ARGS="--text-layers 1 --vision-layers 1" bash tests/perf/gpu_vision_mtmd.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
OUT=${OUT:-/tmp/out}
SHAPES=${SHAPES:-gemma3-4b qwen25vl-7b}
ROUNDS=${ROUNDS:-5}
THREADS=${THREADS:-8}
END_S=${END_S:-470}  # every bench's timeout ends by then (the whole call stays under 8 minutes)
DEVICE=${DEVICE:-cuda}
LLB=${LLB:-/tmp/llb}  # llama.cpp's bin/ goes under it (the carried libs' run path is /tmp/llb/bin)
S=${MTMD_SRC:-/tmp/mtmd-src}  # llama.cpp's headers (include/, ggml/include/, tools/mtmd/)
C=.vismtmd
VLM=${VLM:-/tmp/vlm}  # the generated pairs
mkdir -p "$OUT" "$VLM"
if [ -z "${NO_INSTALL:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $C/*.whl
  mkdir -p /tmp/site && ln -sfn "$PWD" /tmp/site/localllm
  export PYTHONPATH=/tmp/site:$PWD
fi
# the files first (4 writers in parallel; nothing else runs meanwhile)
date -u
for sh in $SHAPES; do
  for part in text mmproj; do
    timeout 180 python3 tests/perf/make_synthetic_vlm_big.py --shape "$sh" --part $part -o "$VLM" \
      ${MAKE_ARGS:-} >>"$OUT/make.log" 2>&1 &
  done
done
# llama.cpp's libs (their run path is /tmp/llb/bin) and the driver, meanwhile
[ -e $LLB/bin/libmtmd.so ] || { mkdir -p $LLB && cat $C/llb.part.* | xz -d | tar x -C $LLB; }
[ -e $S/tools/mtmd/mtmd.h ] || { mkdir -p $S && xz -dc $C/mtmd-include.tar.xz | tar x -C $S; }
L=$LLB/bin
CC=${CC:-$(command -v gcc || command -v cc || command -v clang)}
$CC -O2 -o /tmp/mtmd_ttft tests/perf/mtmd_ttft.c -I$S/include -I$S/ggml/include -I$S/tools/mtmd \
  -L$L -lmtmd -lllama -lggml -lggml-base -Wl,-rpath,$L -Wl,--allow-shlib-undefined \
  || { echo "building mtmd_ttft failed"; exit 1; }
export LD_LIBRARY_PATH=$L${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  nproc | sed 's/^/cpus /'; } | tee "$OUT/machine.txt"
wait
cat "$OUT/make.log"
date -u
for sh in $SHAPES; do
  case $sh in gemma3-4b) side=${SIDE:-896} ;; *) side=${SIDE:-1024} ;; esac
  left=$((END_S - SECONDS))
  [ $left -gt 30 ] || { echo "skip $sh: ${SECONDS}s used of END_S=$END_S"; continue; }
  [ $left -lt 200 ] || left=200
  echo "== $sh at ${SECONDS}s (timeout ${left}s)"
  timeout $left python3 tests/perf/bench_vision_vs_mtmd.py --device "$DEVICE" --threads "$THREADS" \
    --rounds "$ROUNDS" --side $side --text "$VLM/$sh-text.gguf" --mmproj "$VLM/$sh-mmproj.gguf" \
    --llama-driver /tmp/mtmd_ttft --llama-bin $L --json "$OUT/vision_mtmd_$sh.json" \
    ${HALF_TOWER:+--half-tower $HALF_TOWER} 2>&1 \
    | tee "$OUT/vision_mtmd_$sh.md" | grep -vE '^(ours (encode|ttft) |mtmd_ttft (warm-up )?\{)'
  date -u
done
{ echo "# gpu_vision_mtmd $(date -u +%FT%TZ) on $(head -1 "$OUT/machine.txt")"
  for sh in $SHAPES; do
    echo; echo "## $sh"
    grep -E "^(\||img[0-9]+\.png|(ours|mtmd_ttft) loaded|ours / llama|mtmd_ttft failed)" "$OUT/vision_mtmd_$sh.md" || tail -5 "$OUT/vision_mtmd_$sh.md"
  done; } >"$OUT/summary.md"
cat "$OUT/summary.md"
echo "done at ${SECONDS}s"
