"""The process-wide settings a `localllm` process takes at its entry point (`cli.entry`, and
`python -m localllm.app.bench`), not where an engine is built: they change the whole process,
and a test process that builds engines must stay as it is.

- glibc's malloc thresholds (`kernels.cpu.malloc_tuning`): prompt-sized host tensors reused
  instead of page-faulted afresh; off with LOCALLLM_MALLOC_TUNING=0, and left alone where the
  user set glibc's own MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ / GLIBC_TUNABLES.
"""

import os


def apply_settings() -> bool:
    """Apply them; True where the malloc thresholds were set. Imports no torch."""
    from localllm.kernels.cpu import malloc_tuning

    if os.environ.get("LOCALLLM_MALLOC_TUNING", "1") == "0":
        return False
    if any(k in os.environ for k in malloc_tuning.USER_SET):
        return False
    return malloc_tuning.keep_transients_in_heap()
