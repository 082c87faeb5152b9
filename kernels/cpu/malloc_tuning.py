"""glibc's malloc thresholds for the engine's host transients.

torch takes CPU tensors from malloc. glibc serves a block past its mmap threshold (dynamic, at
most 32 MiB) with a fresh mapping and unmaps it on free, so every prompt-sized transient above
that (an 8B model's 512-row gate|up output is 58.7 MB) is page-faulted afresh, 4 KiB at a time,
on every call: ~8 % of an 8B pp512 on the 2026-12-06 Zen 5 (tests/perf/results/cpu.md). Raising
the threshold to `MMAP_THRESHOLD` keeps such blocks in the heap for reuse; larger ones (KV
caches, whole weights) stay mappings that go back to the system on free. `TRIM_THRESHOLD` is how
much free memory the heap's top may keep; `release_free_memory` hands free heap pages back (the
engine calls it when it closes, so an unloaded model's blocks do not stay resident).

A process-wide setting, so the process decides: the `localllm` command's entry point
(`app.cli.entry`) applies it unless LOCALLLM_MALLOC_TUNING=0 or the user set glibc's own
MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ / GLIBC_TUNABLES; a library user calls
`keep_transients_in_heap()` themselves. A no-op off glibc.
"""

import ctypes
import ctypes.util
import functools
import threading

MMAP_THRESHOLD = 128 << 20  # bytes: blocks below this come from the heap
TRIM_THRESHOLD = 256 << 20  # bytes of free heap top kept before trimming
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
USER_SET = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")  # glibc's own
_lock = threading.Lock()
_applied: bool | None = None


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018 (only glibc has it)
    except (OSError, AttributeError):
        return None
    return libc


def keep_transients_in_heap() -> bool:
    """Set the thresholds once per process; True where they are in effect."""
    global _applied
    with _lock:
        if _applied is None:
            libc = _glibc()
            ok = libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
            _applied = bool(ok and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
        return _applied


def release_free_memory() -> None:
    """Return the heap's free pages to the system (glibc's malloc_trim); a no-op elsewhere."""
    if _applied:
        libc = _glibc()
        if libc is not None:
            libc.malloc_trim(0)
