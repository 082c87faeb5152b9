"""`kernels/cpu/malloc_tuning` as the `localllm` command applies it (`app.process.apply_settings`):
each case in a fresh interpreter (the setting is process-wide), read back from /proc: where a
60 MiB torch tensor lives, and what the process keeps resident."""

import os
import subprocess
import sys
import textwrap

import pytest

from localllm.kernels.cpu import malloc_tuning

pytestmark = pytest.mark.skipif(
    malloc_tuning._glibc() is None or not os.path.exists("/proc/self/maps"),
    reason="glibc on Linux only",
)

PROBE = textwrap.dedent("""
    import sys
    import torch
    from localllm.app.process import apply_settings
    from localllm.kernels.cpu import malloc_tuning as m

    def where(t):
        p = t.data_ptr()
        for line in open("/proc/self/maps"):
            a, b = (int(v, 16) for v in line.split()[0].split("-"))
            if a <= p < b:
                return "heap" if line.rstrip().endswith("[heap]") else f"{(b - a) >> 20}MiB"

    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) >> 10

    applied = apply_settings()
    x = torch.ones(60 << 20, dtype=torch.uint8)
    print(applied, where(x))
    if "release" in sys.argv:
        xs = [torch.ones(60 << 20, dtype=torch.uint8) for _ in range(3)]
        del x, xs
        before = rss()
        m.release_free_memory()
        print(before - rss())
""")


def _run(env: dict[str, str], *args: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in malloc_tuning.USER_SET} | env
    done = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True,
                          env=env, check=True, timeout=120)  # fmt: skip
    return done.stdout.split()


def test_prompt_sized_tensors_come_from_the_heap():
    assert _run({}) == ["True", "heap"]


def test_off_switch_and_a_users_own_setting_leave_glibc_alone():
    """Without the tuning a 60 MiB block is its own mapping (glibc's default: at most 32 MiB
    from the heap), which is what the tuning exists to avoid."""
    off = _run({"LOCALLLM_MALLOC_TUNING": "0"})
    assert off[0] == "False" and off[1] != "heap"
    user = _run({"MALLOC_TRIM_THRESHOLD_": "1000000"})
    assert user[0] == "False" and user[1] != "heap"


def test_release_returns_free_heap_pages():
    """Four freed 60 MiB heap blocks stay resident (below the trim threshold) until
    `release_free_memory`, which hands at least three of them back."""
    out = _run({}, "release")
    assert out[:2] == ["True", "heap"]
    assert int(out[2]) >= 150  # MiB
