"""Decode attention over the paged KV cache on the CPU through `decode_step.c`'s `paged_decode`:
the native decode step's own attention, for the single-token rows of the torch path. A row's bits
then depend on its own sequence alone: torch's batched matmuls (2.13, MKL, AVX-512) gave the first
matrix of a batch other bits than the rest, so identical requests side by side ended differently.
The reference is `kernels.attention.paged`'s torch path (tests/kernels/test_cpu_paged_decode.py).
"""

import ctypes
import functools

import torch

from localllm.kernels.cpu import decode_step


@functools.cache
def _lib() -> ctypes.CDLL | None:
    return decode_step.load()


def supports(q, k_cache, v_cache, softcap=None, sinks=None, k_scales=None) -> bool:
    """Whether `paged_decode` serves these operands: float32 queries on the CPU over a plain
    float32 or float16 cache with one head size for K and V, no softcap or sinks, and a library
    that builds here."""
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float32
        and softcap is None
        and sinks is None
        and k_scales is None
        and k_cache.dtype in (torch.float32, torch.float16)
        and v_cache.dtype == k_cache.dtype
        and k_cache.shape == v_cache.shape
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and q.shape[-1] == k_cache.shape[-1]
        and q.shape[1] % k_cache.shape[2] == 0
        and _lib() is not None
    )


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lens: torch.Tensor,
    tables: torch.Tensor,
    scale: float,
    window: int | None = None,
    threads: int | None = None,
) -> torch.Tensor:
    """q [n, H, D] (one new token per sequence, already in the cache) over caches [blocks,
    block_size, KV, D]; lens [n] and tables [n, W] int64 -> [n, H, D] float32."""
    n, heads, hd = q.shape
    kvh = k_cache.shape[2]
    q = q.contiguous()
    lens, tables = lens.contiguous(), tables.contiguous()
    threads = threads or torch.get_num_threads()
    ctx = int(lens.max())
    if window:
        ctx = min(ctx, window + k_cache.shape[1])  # a window's keys start inside a block
    # per thread: scores of up to MAX_GROUP_HEADS heads over the context, and one widened K/V row
    stride = min(heads // kvh, decode_step.MAX_GROUP_HEADS) * ctx + 2 * hd
    sc = torch.empty(threads * stride)
    out = torch.empty(n, heads, hd)
    ptr = torch.Tensor.data_ptr
    _lib().paged_decode(
        n, ptr(q), ptr(k_cache), ptr(v_cache), int(k_cache.dtype == torch.float16), heads, kvh,
        hd, k_cache.shape[1], scale, window or 0, ptr(lens), ptr(tables), tables.shape[1],
        ptr(out), ptr(sc), stride, threads,
    )  # fmt: skip
    return out
