#!/usr/bin/env bash
# One device call for music (issue 37): MusicGen's GPU tests (the captured decode graph against the
# same step eager, on the tiny fixtures), then bench_music.py on real-shape random-weight
# musicgen-small and -medium folders made there with transformers: ours (captured graph), ours
# without the graph, and transformers, on the same weights in the same run, 10 s of audio each.
# About 3-4 minutes on an H100/H200.
#
#   bash tests/perf/gpu_music.sh prepare      # here, once: wheels the device image lacks -> .whlmusic
#   device run: command "bash tests/perf/gpu_music.sh", carry [".whlmusic"]
#
# Env: IMPLS (default ours,ours-eager,hf; add ours-bf16,hf-bf16 for half precision), SIZES
# (default "small medium"), MUSIC_SECONDS (10). $OUT collects pytest.log and bench.md.
set -u
WHEELS=.whlmusic
if [ "${1:-}" = prepare ]; then
  grep -qx "/$WHEELS/" .git/info/exclude || echo "/$WHEELS/" >>.git/info/exclude
  rm -rf "$WHEELS" && mkdir -p "$WHEELS"
  # the image has torch/triton/numpy/pytest; transformers (folders, the reference), tokenizers,
  # safetensors and the audio readers the tests use come from here, with their dependencies
  python -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$WHEELS" transformers tokenizers safetensors soundfile soxr 2>&1 | grep -v "^WARNING" || true
  rm -f "$WHEELS"/numpy-* "$WHEELS"/torch-* "$WHEELS"/nvidia_* "$WHEELS"/triton-*
  ls "$WHEELS" && du -sh "$WHEELS"
  exit 0
fi
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHEELS"/*.whl
ln -sfn "$PWD" /tmp/site/localllm
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
date -u
# the real-shape folders (random init on the GPU, then saved) while the tests run
python3 - >/tmp/make.log 2>&1 <<'EOF' &
import sys
from pathlib import Path
sys.path.insert(0, "tests/perf")
import bench_music
for size in ("small", "medium"):
    bench_music.make_folder(Path(f"/tmp/musicgen-{size}-random"), size, "cuda")
    print(size, "made", flush=True)
EOF
MAKE=$!
timeout "${TEST_T:-150}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/media/music 2>&1 \
  | tee "$OUT/pytest.log" | grep -v "^\." | tail -15
date -u
wait $MAKE || { tail -5 /tmp/make.log; exit 1; }
for size in ${SIZES:-small medium}; do
  timeout 240 python3 tests/perf/bench_music.py --device cuda --size "$size" --threads 16 \
    --seconds "${MUSIC_SECONDS:-10}" --impls "${IMPLS:-ours,ours-eager,hf}" 2>&1 \
    | grep -v -i "warn" | tee -a "$OUT/bench.md" | grep -E '^\||"impl"|Error'
  date -u
done
