"""Programmatic dependent launch (PDL) for the decode kernels on Hopper and later GPUs.

A decode step is a chain of ~400 small kernels (H200: 1.5-25 us each), and each one's launch and
first round trip to memory used to start only after the previous kernel had drained. Launched
with PDL, a kernel's programs are placed while its predecessor still runs once that predecessor
has released them (`gdc_begin`: small kernels at their start, GEMVs after their main loop, so
the kernels placed ahead are one, not a chain streaming weights meanwhile). They may read or
prefetch what no earlier kernel writes (weights), and wait (`gdc_wait`) before they read or
write anything else. The wait returns once the predecessor has finished and its writes are
visible, which in turn waited for its own predecessor, so the chain keeps stream order. Host
side: `enabled(tensor)`. H200 figures: tests/perf/results/gpu-dense.md, "Programmatic dependent
launch".

Rule for every kernel launched with PDL: nothing but immutable data is touched before `gdc_wait`.
Under the triton interpreter (CPU tests) PDL is off and the helpers are no-ops.
"""

from functools import cache

import torch
import triton
import triton.language as tl

try:  # triton >= 3.3; older versions launch everything without PDL
    from triton.language.extra.cuda import gdc_launch_dependents
    from triton.language.extra.cuda import gdc_wait as _gdc_wait

    HAS_GDC = True
except ImportError:
    HAS_GDC = False

    @triton.jit
    def gdc_launch_dependents():
        pass

    @triton.jit
    def _gdc_wait():
        pass


# PDL for kernels launched eagerly too, not only inside CUDA-graph captures (an A/B switch for
# tests/perf: prompts are launched eagerly and are bound by the host's launch rate)
EAGER = True


@cache
def _capable(index: int) -> bool:
    return HAS_GDC and torch.cuda.get_device_capability(index)[0] >= 9


def enabled(t: torch.Tensor) -> bool:
    """Whether launches over CUDA tensor `t` use PDL (sm_90 and later)."""
    if not t.is_cuda:
        return False
    index = t.device.index
    if not _capable(torch.cuda.current_device() if index is None else index):
        return False
    return EAGER or torch.cuda.is_current_stream_capturing()


def launch_options(on: bool) -> dict:
    """Keyword arguments of a kernel launch: the PDL constexpr and the launch attribute."""
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def gdc_begin(PDL: tl.constexpr):
    """Let the next kernel's programs be placed now (a hint; completion implies it)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def gdc_wait(PDL: tl.constexpr):
    """Wait until the previous kernel has finished and its writes are visible."""
    if PDL:
        _gdc_wait()


@triton.jit
def prefetch_l2(ptrs, mask, PDL: tl.constexpr):
    """Ask for the cache lines at `ptrs` (global memory) to be brought into L2; no registers are
    filled and nothing waits. Only with PDL, where it overlaps the previous kernel's tail."""
    if PDL:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
            "=r,l,r",
            [ptrs, mask.to(tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def prefetch_plane(ptr, row0, R: tl.constexpr, col0, N, ok, BN: tl.constexpr, PDL: tl.constexpr):
    """Prefetch rows row0..row0+R-1, columns col0..col0+BN-1 of a row-major [rows, N] plane of
    4-byte words: one request per 128-byte line (2-byte planes get two per line). `ok`: scalar."""
    if PDL and BN >= 32:
        lines = col0 + tl.arange(0, BN // 32) * 32
        r = row0 + tl.arange(0, R)
        m = (lines < N)[None, :] & ok
        prefetch_l2(ptr + r[:, None] * N + lines[None, :], m, PDL)
