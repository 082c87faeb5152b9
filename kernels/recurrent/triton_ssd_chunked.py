"""The Mamba-2 scan of a prompt in chunks on CUDA (Triton; or CPU tensors under TRITON_INTERPRET=1
in tests): every sequence of a flat batch, its rows cut into chunks of L tokens, in three
launches, and none of them walks the tokens one by one.

`triton_step.ssd_varlen_triton` scans token by token: 512 dependent steps per layer for a
512-token prompt, on a grid of heads x head-dim blocks only (96 programs for Granite-4.0-H-Tiny),
so the GPU waits on memory latency step after step. Here (the SSD form of `ssd.ssd_chunked`,
what llama.cpp's CUDA backend also runs from 128 tokens on):

1. `_chunk_state`: per (chunk, head, P block) the state the chunk adds from zeros,
   sum_j exp(c_L - c_j) dt_j x_j B_j^T, and its decay exp(c_L) (c: the cumulative dt A); per
   (chunk, group) C_i . B_j, which every head of the group reads in 3.
2. `_state_pass`: per (sequence, head, block of the state) the states entering each chunk, in
   chunk order (a few steps: 8 at 512 tokens), written over the chunk states; the sequence's
   final state into `state`.
3. `_chunk_out`: per (chunk, head, P block) y_i = exp(c_i) C_i S_in + sum_{j<=i} exp(c_i - c_j)
   (C_i . B_j) dt_j x_j: matmuls within the chunk.

float32 throughout; the matmuls take IEEE float32 inputs (DOT_PRECISION). Not the default path:
`engine.layers.recurrent.CHUNKED_MIN_ROWS` turns it on. "ieee" tl.dot has no tensor-core form
on Hopper: it compiles to FMA loops holding the tiles in registers, and they spill (triton
3.9's ptxas for sm_90, tests/perf/ssd_kernel_regs.py: KBs of local memory a thread); "tf32x3"
runs three tf32 tensor-core products (hi*hi + hi*lo + lo*hi), about IEEE's accuracy. On an H100
at Granite-4.0-H-Tiny's shape (2026-12-06, tests/perf/results/hybrid.md): 1,079 us a layer
here, 117 us with "tf32x3", 154 us "ieee" at 8 warps, 248 us token by token. The torch
reference is `ssd.ssd_scan` per sequence (`tests/kernels/test_ssd_chunked_triton.py`).
"""

import torch
import triton
import triton.language as tl

CHUNK = 64  # tokens per chunk (tl.dot wants sides of 16 and more)
# "tf32x3" (tensor cores, 3 passes) is the candidate, to be timed in the whole forward first
# (tests/perf/gpu_hybrid_prefill.sh, SSD_DOT_PRECISION); "tf32" rounds inputs to 10 bits
DOT_PRECISION = "ieee"
BLOCK_P = 32  # head-dim columns per program
WARPS = 4  # per program of the chunk kernels


@triton.jit
def _chunk_rows(chunks_ptr, dt_ptr, a_ptr, c, h, H, L: tl.constexpr):
    """This chunk's rows, which exist, dt [L] (0 past the end) and cumulative dt A [L]."""
    r0 = tl.load(chunks_ptr + c * 2)
    r1 = tl.load(chunks_ptr + c * 2 + 1)
    rows = r0 + tl.arange(0, L)
    mr = rows < r1
    dt = tl.load(dt_ptr + rows.to(tl.int64) * H + h, mask=mr, other=0.0)
    cum = tl.cumsum(dt * tl.load(a_ptr + h), axis=0)
    return rows.to(tl.int64), mr, dt, cum


@triton.jit
def _chunk_state(
    x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, chunks_ptr, ds_ptr, da_ptr, cb_ptr,
    SX, SB, SC, H, P, N, HPG, G,
    L: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    p = tl.program_id(2) * BP + tl.arange(0, BP)
    n = tl.arange(0, BN)
    mp, mn = p < P, n < N
    rows, mr, dt, cum = _chunk_rows(chunks_ptr, dt_ptr, a_ptr, c, h, H, L)
    last = tl.sum(dt * tl.load(a_ptr + h), axis=0)  # c_L (dt is 0 past the end)
    w = tl.exp(last - cum) * dt  # 0 on rows past the end (dt = 0)
    x = tl.load(x_ptr + rows[:, None] * SX + h * P + p[None, :], mask=mr[:, None] & mp[None, :],
                other=0.0)  # fmt: skip
    g = h // HPG
    b = tl.load(b_ptr + rows[:, None] * SB + g * N + n[None, :], mask=mr[:, None] & mn[None, :],
                other=0.0)  # fmt: skip
    ds = tl.dot(tl.trans(x * w[:, None]), b, input_precision=PREC)  # [BP, BN]
    offs = ((c * H + h) * P + p)[:, None] * N + n[None, :]
    tl.store(ds_ptr + offs, ds, mask=mp[:, None] & mn[None, :])
    tl.store(da_ptr + c * H + h, tl.exp(last))
    if (h % HPG == 0) & (tl.program_id(2) == 0):  # C_i . B_j [L, L], once per (chunk, group)
        cc = tl.load(c_ptr + rows[:, None] * SC + g * N + n[None, :],
                     mask=mr[:, None] & mn[None, :], other=0.0)  # fmt: skip
        cb = tl.dot(cc, tl.trans(b), input_precision=PREC)
        i = tl.arange(0, L)
        tl.store(cb_ptr + ((c * G + g) * L + i)[:, None] * L + i[None, :], cb)


@triton.jit
def _state_pass(state_ptr, ds_ptr, da_ptr, seq_chunks_ptr, H, PN, BLOCK: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    i = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    m = i < PN
    st = tl.load(state_ptr + (s * H + h) * PN + i, mask=m, other=0.0)
    c0 = tl.load(seq_chunks_ptr + s).to(tl.int64)
    c1 = tl.load(seq_chunks_ptr + s + 1).to(tl.int64)
    for c in range(c0, c1):
        off = (c * H + h) * PN + i
        d = tl.load(ds_ptr + off, mask=m, other=0.0)
        tl.store(ds_ptr + off, st, mask=m)  # now the state entering chunk c
        st = tl.load(da_ptr + c * H + h) * st + d
    tl.store(state_ptr + (s * H + h) * PN + i, st, mask=m)


@triton.jit
def _chunk_out(
    x_ptr, dt_ptr, a_ptr, c_ptr, cb_ptr, chunks_ptr, sin_ptr, y_ptr,
    SX, SC, H, P, N, HPG, G,
    L: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    p = tl.program_id(2) * BP + tl.arange(0, BP)
    n = tl.arange(0, BN)
    mp, mn = p < P, n < N
    rows, mr, dt, cum = _chunk_rows(chunks_ptr, dt_ptr, a_ptr, c, h, H, L)
    g = h // HPG
    m_rn = mr[:, None] & mn[None, :]
    cc = tl.load(c_ptr + rows[:, None] * SC + g * N + n[None, :], mask=m_rn, other=0.0)
    i = tl.arange(0, L)
    cb = tl.load(cb_ptr + ((c * G + g) * L + i)[:, None] * L + i[None, :])  # C_i . B_j
    seg = cum[:, None] - cum[None, :]
    # masked before exp: above the diagonal c_i - c_j > 0 could overflow
    decay = tl.exp(tl.where(i[None, :] <= i[:, None], seg, float("-inf")))
    x = tl.load(x_ptr + rows[:, None] * SX + h * P + p[None, :], mask=mr[:, None] & mp[None, :],
                other=0.0)  # fmt: skip
    y = tl.dot(cb * decay * dt[None, :], x, input_precision=PREC)  # [L, BP]
    s_in = tl.load(sin_ptr + ((c * H + h) * P + p)[:, None] * N + n[None, :],
                   mask=mp[:, None] & mn[None, :], other=0.0)  # fmt: skip
    y += tl.exp(cum)[:, None] * tl.dot(cc, tl.trans(s_in), input_precision=PREC)
    tl.store(y_ptr + (rows[:, None] * H + h) * P + p[None, :], y, mask=mr[:, None] & mp[None, :])


def chunk_table(query_start: list[int], chunk: int | None = None) -> tuple[list[int], list[int]]:
    """(each chunk's rows as flat (start, end) pairs, each sequence's first chunk and the end),
    from a flat batch's host offsets: sequence b's rows cut into chunks of `chunk` (default
    CHUNK) tokens."""
    chunk = chunk or CHUNK
    rows: list[int] = []
    first = [0]
    for b in range(len(query_start) - 1):
        for s in range(query_start[b], query_start[b + 1], chunk):
            rows += (s, min(s + chunk, query_start[b + 1]))
        first.append(len(rows) // 2)
    return rows, first


def ssd_chunked_triton(
    x, dt, A, B, C, state, chunks: torch.Tensor, seq_chunks: torch.Tensor, chunk: int | None = None
) -> torch.Tensor:
    """Every sequence of a flat batch: x [T, H, P], dt [T, H], A [H], B and C [T, G, N] (rows
    may be strided views: the last dims contiguous), state [S, H, P, N] float32 contiguous,
    updated in place; `chunks` int32 [n_chunks, 2] (rows start, end) and `seq_chunks` int32
    [S + 1] on the device, as `chunk_table` makes them for `chunk` (default CHUNK). Returns
    y [T, H, P] float32 (what `ssd.ssd_scan` gives per sequence)."""
    chunk = chunk or CHUNK
    t, h, p = x.shape
    g, n = B.shape[1], B.shape[2]
    x, B, C = (_rows(v) for v in (x, B, C))
    dt = dt.float().contiguous()
    a = A.float().contiguous()
    nc = chunks.shape[0]
    y = torch.empty(t, h, p, dtype=torch.float32, device=x.device)
    ds = torch.empty(nc, h, p, n, dtype=torch.float32, device=x.device)
    da = torch.empty(nc, h, dtype=torch.float32, device=x.device)
    bp = max(16, min(BLOCK_P, triton.next_power_of_2(p)))
    bn = max(16, triton.next_power_of_2(n))
    grid = (nc, h, triton.cdiv(p, bp))
    common = dict(L=chunk, BP=bp, BN=bn, PREC=DOT_PRECISION, num_warps=WARPS)
    cb = torch.empty(nc, g, chunk, chunk, dtype=torch.float32, device=x.device)
    _chunk_state[grid](x, dt, a, B, C, chunks, ds, da, cb, x.stride(0), B.stride(0), C.stride(0),
                       h, p, n, h // g, g, **common)  # fmt: skip
    block = min(1024, triton.next_power_of_2(p * n))
    _state_pass[(state.shape[0], h, triton.cdiv(p * n, block))](state, ds, da, seq_chunks, h,
                                                                p * n, BLOCK=block)  # fmt: skip
    _chunk_out[grid](x, dt, a, C, cb, chunks, ds, y, x.stride(0), C.stride(0), h, p, n, h // g,
                     g, **common)  # fmt: skip
    return y


def _rows(v: torch.Tensor) -> torch.Tensor:
    """float32 with contiguous rows (a strided row view, a split of a wider row, stays as is)."""
    v = v.float()
    inner = v.shape[1:]
    want, size = [], 1
    for d in reversed(inner):
        want.insert(0, size)
        size *= d
    if list(v.stride()[1:]) != want or v.stride(0) < size:
        v = v.contiguous()
    return v
