"""Prompt attention over the paged KV cache on the CPU through `prompt_attention.c`: a chunk of
query rows of one or more sequences, causal, GQA, an optional window, float32 or float16 caches
(the operands `kernels.cpu.paged_decode.supports`). Each K/V block is read once per tile of query
vectors and a row's bits depend only on its own query, position, context and the cache, never on
the chunk it came in, its place in a tile or the thread count (why: issue 39, a prompt tail after
a prefix-cache hit must give the same bits as inside the whole chunk).

`load()` answers the library or None (no compiler, or its self-check failed: callers keep the
row-by-row decode kernel). `prompt_attention_reference` is the same math in float64 torch, the
oracle of tests/kernels/test_cpu_prompt_attention.py.
"""

import ctypes
import functools
from collections.abc import Sequence
from pathlib import Path

import torch

from localllm.kernels.cpu.cbuild import built_libraries, checked

SOURCE = Path(__file__).with_name("prompt_attention.c")
# -ffp-contract=off: no fusing the compiler chooses per call site (a row's bits must not depend
# on which copy of a loop computed it); the kernel's FMAs are explicit
FLAG_SETS = (
    ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off"),
    ("-O3", "-fopenmp", "-ffp-contract=off"),
    ("-O3", "-ffp-contract=off"),
)
CHECK_TOL = 1e-4  # against the float64 reference: float32 sums; a wrong kernel is ~1
_I, _P, _D = ctypes.c_int64, ctypes.c_void_p, ctypes.c_double


def prompt_attention_reference(q, k_cache, v_cache, query_start, seq_lens, block_tables, scale,
                               window=None) -> torch.Tensor:  # fmt: skip
    """float64 math, float32 out [T, H, D]: sequence b's rows query_start[b]:query_start[b + 1]
    are its last tokens of seq_lens[b]; row i of t at position n - t + i sees keys
    max(0, pos + 1 - window) .. pos."""
    heads = q.shape[1]
    kvh, bs = k_cache.shape[2], k_cache.shape[1]
    out = torch.empty(q.shape[0], heads, v_cache.shape[-1])
    for b, n in enumerate(seq_lens):
        s, e = query_start[b], query_start[b + 1]
        ids = list(block_tables[b][: -(-n // bs)])
        keys = k_cache[ids].flatten(0, 1)[:n].double().repeat_interleave(heads // kvh, 1)
        vals = v_cache[ids].flatten(0, 1)[:n].double().repeat_interleave(heads // kvh, 1)
        for i in range(e - s):
            pos = n - (e - s) + i
            lo = max(0, pos + 1 - window) if window else 0
            sc = torch.einsum("hd,khd->hk", q[s + i].double(), keys[lo : pos + 1]) * scale
            out[s + i] = torch.einsum("hk,khd->hd", sc.softmax(-1), vals[lo : pos + 1]).float()
    return out


def _bind(lib: ctypes.CDLL) -> None:
    lib.prompt_attention.argtypes = [_I, _P, _P, _P, _I, _I, _I, _I, _I, _D, _I, _P, _P, _P, _P,
                                     _I, _P, ctypes.c_int]  # fmt: skip
    lib.prompt_attention.restype = ctypes.c_int


def _run(lib, q, k_cache, v_cache, rows, seq_lens, tables, scale, window, threads, out):
    """rows: (start, count) per sequence in q's flat rows; out [T, H, D] filled at those rows."""
    starts = torch.tensor([r[0] for r in rows], dtype=torch.int64)
    counts = torch.tensor([r[1] for r in rows], dtype=torch.int64)
    lens = torch.tensor(list(seq_lens), dtype=torch.int64)
    width = max(len(t) for t in tables)
    tab = torch.zeros(len(tables), max(width, 1), dtype=torch.int64)
    for i, t in enumerate(tables):
        tab[i, : len(t)] = torch.as_tensor(list(t), dtype=torch.int64)
    ptr = torch.Tensor.data_ptr
    rc = lib.prompt_attention(
        len(rows), ptr(q), ptr(k_cache), ptr(v_cache), int(k_cache.dtype == torch.float16),
        q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1], scale, window or 0,
        ptr(starts), ptr(counts), ptr(lens), ptr(tab), tab.shape[1], ptr(out),
        threads or torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise MemoryError("prompt_attention: no memory for its scratch")
    return out


def self_check(lib: ctypes.CDLL) -> bool:
    """GQA groups 1, 3 and 4 (a tile of several rows, padding lanes), both cache types, a window,
    a head size with a short last chunk of lanes, scattered blocks."""
    gen = torch.Generator().manual_seed(0)
    for heads, kvh, hd, dtype, window in ((4, 4, 16, torch.float32, None),
                                          (6, 2, 24, torch.float16, 5),
                                          (8, 2, 32, torch.float32, None)):  # fmt: skip
        k, v = (torch.randn(6, 4, kvh, hd, generator=gen).to(dtype) for _ in range(2))
        q = torch.randn(9, heads, hd, generator=gen)
        qs, lens, tables = (0, 7, 9), (21, 5), ((5, 0, 3, 1, 2, 4), (4, 2))
        want = prompt_attention_reference(q, k, v, qs, lens, tables, hd**-0.5, window)
        got = _run(lib, q, k, v, [(0, 7), (7, 2)], lens, tables, hd**-0.5, window, 2,
                   torch.empty_like(q))  # fmt: skip
        if not ((got - want).abs().max() <= CHECK_TOL):
            return False
    return True


@functools.cache
def load(cache_dir: Path | None = None) -> ctypes.CDLL | None:
    """The compiled kernel, checked, or None."""
    for lib, path, _ in built_libraries((SOURCE,), FLAG_SETS, "localllm-prompt-attention", _bind,
                                        cache_dir):  # fmt: skip
        if checked(path, lambda: self_check(lib)):  # noqa: B023 (called at once)
            return lib
    return None


def prompt_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    scale: float,
    window: int | None = None,
    threads: int | None = None,
    out: torch.Tensor | None = None,
    seqs: Sequence[int] | None = None,
) -> torch.Tensor:
    """q [T, H, D] float32 (sequence b's rows query_start[b]:query_start[b + 1], its last
    tokens, already in the cache) over caches [blocks, block_size, KV, D] float32 or float16
    -> [T, H, D] float32 (into `out` at those rows when given; `seqs`: only these sequences'
    rows). The caller checked `paged_decode.supports` and `load()`."""
    q = q.contiguous()
    if out is None:
        out = torch.empty(q.shape, dtype=torch.float32)
    seqs = range(len(seq_lens)) if seqs is None else seqs
    rows = [(query_start[b], query_start[b + 1] - query_start[b]) for b in seqs]
    lens, tables = [seq_lens[b] for b in seqs], [block_tables[b] for b in seqs]
    for b, (_, t), n, tab in zip(seqs, rows, lens, tables, strict=True):
        if t > n or -(-n // k_cache.shape[1]) > len(tab):
            raise ValueError(f"sequence {b}: {t} rows, {n} tokens, {len(tab)} blocks")
    return _run(load(), q, k_cache, v_cache, rows, lens, tables, scale, window, threads, out)
