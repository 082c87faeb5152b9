#!/usr/bin/env bash
# Pack what `gpu_hybrid2.sh` needs on the device into .hyb2 (~42.7 MB), small enough to travel
# with the ~23.7 MB tree under the 64 MiB a device call carries (.whl + .llb take 47 MB):
# - site.tar.xz: the gguf and llguidance wheels of .whl (h200_prepare.sh) unpacked, xz'd (2.0 MB
#   against the wheels' 3.2 MB);
# - llb.part.*: from .llb (gpu_build_llamacpp.sh), llama-bench and the libraries it loads only
#   (no llama-server, mtmd, batched-bench), stripped, xz with the x86 filter (40.7 MB; the CUDA
#   library's fat binary, 36.6 MB of it, does not compress).
# Run here from the repo root (a few minutes of CPU for xz -9e); it ignores .hyb2 in git:
#   bash tests/perf/gpu_hybrid2_pack.sh
set -eu
[ -d .llb ] && ls .whl/gguf-*.whl .whl/llguidance-*.whl >/dev/null \
  || { echo "needs .whl (h200_prepare.sh) and .llb (gpu_build_llamacpp.sh)"; exit 1; }
grep -q "^/.hyb2/" .git/info/exclude || echo "/.hyb2/" >>.git/info/exclude
repo=$PWD
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/site" "$tmp/x" "$tmp/s/bin" .hyb2
rm -f .hyb2/*
for w in .whl/gguf-*.whl .whl/llguidance-*.whl; do
  python3 -m zipfile -e "$w" "$tmp/site"
done
(cd "$tmp" && tar c site | xz -T2 --x86 --lzma2=preset=9e >site.tar.xz)
cp "$tmp/site.tar.xz" .hyb2/
cat .llb/llb.part.* | xz -d | tar x -C "$tmp/x"
(cd "$tmp/x/bin" && cp -a llama-bench libllama-bench-impl.so libllama.so* libllama-common.so* \
  libggml*.so* "$tmp/s/bin/")
(cd "$tmp/s/bin" && for f in *; do [ -L "$f" ] || strip --strip-unneeded "$f"; done)
(cd "$tmp/s" && tar c bin | xz -T2 --x86 --lzma2=preset=9e | split -b 15M - "$repo/.hyb2/llb.part.")
ls -la .hyb2
du -cb .hyb2/* | tail -1
