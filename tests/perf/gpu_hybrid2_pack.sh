#!/usr/bin/env bash
# Pack what `gpu_hybrid2.sh` needs on the device into two ignored folders, small enough to travel
# with the ~24 MB tree under the 64 MiB a device call carries (.whl + .llb take 47 MB):
# - .hyb2 (40.8 MB): llb.part.*, from .llb (gpu_build_llamacpp.sh) llama-bench and the libraries
#   it loads only (no llama-server, mtmd, batched-bench), stripped, xz with the x86 filter (the
#   CUDA library's fat binary, 36.6 MB, does not compress); gguf.tar.xz, the gguf wheel unpacked
#   (the file makers need it);
# - .hyb2w (1.9 MB): llguidance.tar.xz, the llguidance wheel unpacked (the engine imports it).
# One call carries both; where the tree has grown too far for that, two calls split the work
# (see gpu_hybrid2.sh's header). Run here from the repo root (minutes of CPU for xz -9e):
#   bash tests/perf/gpu_hybrid2_pack.sh
set -eu
[ -d .llb ] && ls .whl/gguf-*.whl .whl/llguidance-*.whl >/dev/null \
  || { echo "needs .whl (h200_prepare.sh) and .llb (gpu_build_llamacpp.sh)"; exit 1; }
for d in /.hyb2/ /.hyb2w/; do
  grep -qx "$d" .git/info/exclude || echo "$d" >>.git/info/exclude
done
repo=$PWD
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/x" "$tmp/s/bin" .hyb2 .hyb2w
rm -f .hyb2/* .hyb2w/*
pack() {  # wheel, then the archive it becomes: unpacked under site/, xz'd
  rm -rf "$tmp/site" && mkdir -p "$tmp/site"
  python3 -m zipfile -e "$1" "$tmp/site"
  (cd "$tmp" && tar c site | xz -T2 --x86 --lzma2=preset=9e >"$repo/$2")
}
pack .whl/gguf-*.whl .hyb2/gguf.tar.xz
pack .whl/llguidance-*.whl .hyb2w/llguidance.tar.xz
cat .llb/llb.part.* | xz -d | tar x -C "$tmp/x"
(cd "$tmp/x/bin" && cp -a llama-bench libllama-bench-impl.so libllama.so* libllama-common.so* \
  libggml*.so* "$tmp/s/bin/")
(cd "$tmp/s/bin" && for f in *; do [ -L "$f" ] || strip --strip-unneeded "$f"; done)
(cd "$tmp/s" && tar c bin | xz -T2 --x86 --lzma2=preset=9e | split -b 15M - "$repo/.hyb2/llb.part.")
ls -la .hyb2 .hyb2w
du -cb .hyb2/* .hyb2w/* | tail -1
