#!/usr/bin/env bash
# One device call (~3 min), CPU only (issue 39): the Llama-3.2-1B-shape Q4_K_M one-row decode
# step and output head with the file mapped on 2 MiB pages (the loader's default advice,
# offload.ranges.HUGE_PAGES), on 4 KiB pages, and copied into anonymous huge pages
# (tests/perf/ab_hugepages.py --evict: the file's cache dropped first, so it is read back under
# the advice), at 2, 8 and 16 threads on the GPU machine's cores; with that kernel's THP settings
# and whether MADV_COLLAPSE takes a file mapping there.
# Prepare here first: `bash tests/perf/h200_prepare.sh` (.whl: gguf for make_synthetic.py).
# Then: carry [".whl"]; `bash tests/perf/gpu_hugepages.sh`. Environment: THREADS ["2 8 16"],
# ROUNDS [21]. $OUT gets hugepages.md.
set -u
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LOG="$OUT/hugepages.md"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
ln -sfn "$PWD" /tmp/site/localllm
export PYTHONPATH=/tmp/site:$PWD
{
  echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores:$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
  echo "# tree $(git rev-parse --short HEAD 2>/dev/null || echo '?'), kernel $(uname -r)"
  for f in enabled shmem_enabled defrag; do
    echo "# THP $f: $(cat /sys/kernel/mm/transparent_hugepage/$f 2>/dev/null)"
  done
  (zcat /proc/config.gz 2>/dev/null || cat "/boot/config-$(uname -r)" 2>/dev/null) \
    | grep -E "READ_ONLY_THP_FOR_FS" | sed 's/^/# /'
} | tee "$LOG"
python3 tests/perf/make_synthetic.py --shape llama3-1b --quant Q4_K_M -o /tmp/l1b.gguf >/tmp/make.log 2>&1 \
  || { tail -5 /tmp/make.log; exit 1; }
python3 - <<'PY' 2>&1 | tee -a "$LOG"
import mmap, os
f = os.open("/tmp/l1b.gguf", os.O_RDONLY)
m = mmap.mmap(f, 0, access=mmap.ACCESS_READ)
n = len(m) // (2 << 20) * (2 << 20)
try:
    m.madvise(25, 0, n)  # MADV_COLLAPSE
    print("# MADV_COLLAPSE on the file mapping: taken")
except OSError as e:
    print(f"# MADV_COLLAPSE on the file mapping: errno {e.errno} ({e.strerror})")
PY
for t in ${THREADS:-2 8 16}; do
  timeout 150 python3 tests/perf/ab_hugepages.py --model /tmp/l1b.gguf --evict --threads "$t" \
    --rounds "${ROUNDS:-21}" 2>&1 | tee -a "$LOG"
done
date -u | tee -a "$LOG"
