"""Triton kernels of the recurrent layers on CUDA: the decode step (one launch for the causal
conv step of every sequence, state shifted in place, bias and SiLU fused; one for the Mamba-2
scan step; both on a batch's own states, or in place on the sequences' state slots) and the
prefill of a whole flat batch (`*_varlen`: every sequence's rows, whatever
their lengths, at once: the conv's rows in parallel, then the states; the scan token by token
with the state in registers). Their torch
references: `causal_conv.causal_conv_step` / `causal_conv_prefill`, `ssd.ssd_step_ref` /
`ssd.ssd_scan`; `tests/kernels/test_recurrent_gpu.py` compares them.

A decode step otherwise launches a dozen small torch kernels per layer (concatenate, multiply,
sum, copy back; exp, two products, einsum), and a prompt loops over its sequences and chunks in
Python: here each is one launch over [sequences, channel or head blocks].
"""

import torch
import triton
import triton.language as tl

from localllm.kernels.quant.triton_dp4a import quant_groups
from localllm.kernels.quant.triton_packed import quantized_out


def fresh_flags(fresh: torch.Tensor) -> torch.Tensor:
    """The kernels' per-sequence `fresh` flags: the bool tensor viewed as int8 (no launch)."""
    return fresh.contiguous().view(torch.int8)


@triton.jit
def _conv_step_kernel(
    x_ptr, w_ptr, b_ptr, state_ptr, slot_ptr, fresh_ptr, y_ptr, dt_ptr, dtb_ptr, dto_ptr, q_ptr,
    qd_ptr, s16_ptr, xs_ptr, C, SX, H, K: tl.constexpr, HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr, SLOTS: tl.constexpr, GATED: tl.constexpr, BLOCK_C: tl.constexpr,
    DT: tl.constexpr, BLOCK_H: tl.constexpr, QUANT: tl.constexpr, RN: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0).to(tl.int64)
    # Mamba-2's dt = softplus(dt + bias) of the row's H heads, by its first program
    if DT:  # noqa: SIM102 (a constexpr: compiled out, apart from the runtime test)
        if tl.program_id(1) == 0:
            hh = tl.arange(0, BLOCK_H)
            hm = hh < H
            v = tl.load(dt_ptr + s * SX + hh, mask=hm, other=0.0).to(tl.float32)
            v += tl.load(dtb_ptr + hh, mask=hm, other=0.0)
            # torch's softplus: x past its threshold 20 (as `triton_recurrent`'s)
            soft = tl.where(v > 20.0, v, tl.log(1.0 + tl.exp(tl.minimum(v, 20.0))))
            tl.store(dto_ptr + s * H + hh, soft, mask=hm)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = c < C
    slot = s
    keep = c >= 0  # (as a vector: masks combine per lane)
    if SLOTS:  # the sequence's slot among many; a fresh one's old contents never read
        slot = tl.load(slot_ptr + s)
        keep = (c * 0 + tl.load(fresh_ptr + s).to(tl.int32)) == 0
    row_x = x_ptr + s * SX
    if GATED:  # LFM2: the row is (B, C, x); the conv's input is B * x, its output times C
        xv = tl.load(row_x + c, mask=m, other=0.0).to(tl.float32)
        xv *= tl.load(row_x + 2 * C + c, mask=m, other=0.0).to(tl.float32)
    else:
        xv = tl.load(row_x + c, mask=m, other=0.0).to(tl.float32)
    acc = xv * tl.load(w_ptr + c * K + (K - 1), mask=m, other=0.0)  # the newest input: last tap
    base = state_ptr + slot * (K - 1) * C
    for j in tl.static_range(K - 1):  # state row j: the input K - 1 - j steps back
        row = tl.load(base + j * C + c, mask=m & keep, other=0.0)
        acc += row * tl.load(w_ptr + c * K + j, mask=m, other=0.0)
    for j in tl.static_range(K - 2):  # shift one input out, this one in
        tl.store(base + j * C + c, tl.load(base + (j + 1) * C + c, mask=m & keep, other=0.0),
                 mask=m)  # fmt: skip
    tl.store(base + (K - 2) * C + c, xv, mask=m)
    if HAS_BIAS:
        acc += tl.load(b_ptr + c, mask=m, other=0.0)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    if GATED:
        acc *= tl.load(row_x + C + c, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + s * C + c, acc, mask=m)
    if QUANT:  # the next GEMV's int8 rows (C a multiple of 32; lanes past C hold zeros)
        j = tl.program_id(1) * (BLOCK_C // 32) + tl.arange(0, BLOCK_C // 32)
        k32 = s * (C // 32)
        quant_groups(tl.reshape(acc, (BLOCK_C // 32, 32)), j, j < C // 32, q_ptr + s * (C // 4),
                     qd_ptr + k32, s16_ptr + s * (C // 16), xs_ptr + k32, BLOCK_C // 32,
                     RN)  # fmt: skip


def conv_step_triton(
    x, weight, state, bias=None, silu: bool = False, slots=None, fresh=None, gated: bool = False,
    out_dtype: torch.dtype = torch.float32, dt=None, dt_bias=None, quant: bool = False,
):  # fmt: skip
    """x [S, C], weight [C, K], state [S, K - 1, C] float32 contiguous (updated in place), bias
    [C] or None -> y [S, C] float32 (bias added, then SiLU when `silu`). With `slots` [S] int64
    and `fresh` [S] bool: `state` is [any, K - 1, C] and row s steps slot slots[s] (from zeros
    where fresh). `gated` (LFM2's short conv): x is [S, 3C], each row (B, C, x) side by side as
    the in-projection writes it, the conv's input B * x and y = C * conv; in `out_dtype`.
    `dt` [S, H] (Mamba-2's, a column slice of the same rows as x) and `dt_bias` [H]: returns
    (y, softplus(dt + dt_bias) float32 [S, H]) from the same launch. `quant`: returns (y, its int8
    rows for the next dp4a GEMV, or None where they cannot be made: y not float32, C not a
    multiple of 32), what `quantize_x8` makes of y."""
    s, c = x.shape
    if gated:
        c //= 3
    k = weight.shape[1]
    if x.stride(1) != 1:
        x = x.contiguous()
    w = weight.float().contiguous()
    y = torch.empty(s, c, dtype=out_dtype, device=x.device)
    block = min(256, triton.next_power_of_2(c))
    b = bias.float().contiguous() if bias is not None else w  # (unread without a bias)
    use = slots is not None
    sl = slots.contiguous() if use else y  # (unread without slots)
    fr = fresh_flags(fresh) if use else y
    h = dt.shape[1] if dt is not None else 1
    if dt is not None and (dt.stride(0) != x.stride(0) or dt.stride(1) != 1):
        raise ValueError("dt must be a column slice of x's rows")
    dto = torch.empty(s, h, dtype=torch.float32, device=x.device) if dt is not None else y
    dtb = dt_bias.float().contiguous() if dt is not None else y
    xq, qa = quantized_out(s, c, quant and out_dtype == torch.float32, y)
    _conv_step_kernel[(s, triton.cdiv(c, block))](
        x, w, b, state, sl, fr, y, y if dt is None else dt, dtb, dto, *qa, c, x.stride(0), h,
        K=k, HAS_BIAS=bias is not None, SILU=silu, SLOTS=use, GATED=gated, BLOCK_C=block,
        DT=dt is not None, BLOCK_H=triton.next_power_of_2(h), QUANT=xq is not None,
        RN=x.is_cuda,
    )  # fmt: skip
    if quant:
        return (y, xq) if dt is None else (y, dto, xq)
    return y if dt is None else (y, dto)


@triton.jit
def _ssd_step_kernel(
    x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, state_ptr, slot_ptr, fresh_ptr, y_ptr,
    H, P, N, HEADS_PER_GROUP, G,
    SLOTS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    sh = tl.program_id(0).to(tl.int64)  # sequence * H + head
    s = sh // H
    h = sh % H
    g = h // HEADS_PER_GROUP
    p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    slot = s
    keep = p >= 0  # (as a vector: masks combine per lane)
    if SLOTS:  # the sequence's slot among many; a fresh one's old contents never read
        slot = tl.load(slot_ptr + s)
        keep = (p * 0 + tl.load(fresh_ptr + s).to(tl.int32)) == 0
    n = tl.arange(0, BLOCK_N)
    mp, mn = p < P, n < N
    dt = tl.load(dt_ptr + sh)
    decay = tl.exp(dt * tl.load(a_ptr + h))
    bv = tl.load(b_ptr + (s * G + g) * N + n, mask=mn, other=0.0)
    cv = tl.load(c_ptr + (s * G + g) * N + n, mask=mn, other=0.0)
    xv = tl.load(x_ptr + sh * P + p, mask=mp, other=0.0)
    offs = (slot * H + h) * P * N + p[:, None] * N + n[None, :]
    m2 = mp[:, None] & mn[None, :]
    st = tl.load(state_ptr + offs, mask=m2 & keep[:, None], other=0.0)
    st = st * decay + (dt * xv)[:, None] * bv[None, :]
    tl.store(state_ptr + offs, st, mask=m2)
    tl.store(y_ptr + sh * P + p, tl.sum(st * cv[None, :], axis=1), mask=mp)


def ssd_step_triton(x, dt, A, B, C, state, slots=None, fresh=None) -> torch.Tensor:
    """`ssd.ssd_step_ref` in one launch: x [S, H, P], dt [S, H], A [H], B and C [S, G, N], state
    [S, H, P, N] float32 contiguous, updated in place. Returns y [S, H, P] float32. With `slots`
    [S] int64 and `fresh` [S] bool: `state` is [any, H, P, N] and sequence s steps slot slots[s]
    (from zeros where fresh)."""
    s, h, p = x.shape
    g, n = B.shape[1], B.shape[2]
    x, dt, a = x.float().contiguous(), dt.float().contiguous(), A.float().contiguous()
    b, c = B.float().contiguous(), C.float().contiguous()
    y = torch.empty(s, h, p, dtype=torch.float32, device=x.device)
    block_n = triton.next_power_of_2(n)
    block_p = max(1, min(triton.next_power_of_2(p), 4096 // block_n))  # <= 4096 values a program
    grid = (s * h, triton.cdiv(p, block_p))
    use = slots is not None
    sl = slots.contiguous() if use else y  # (unread without slots)
    fr = fresh_flags(fresh) if use else y
    _ssd_step_kernel[grid](x, dt, a, b, c, state, sl, fr, y, h, p, n, h // g, g, SLOTS=use,
                           BLOCK_P=block_p, BLOCK_N=block_n)  # fmt: skip
    return y


@triton.jit
def _conv_rows_kernel(
    x_ptr, w_ptr, b_ptr, state_ptr, y_ptr, seq_ptr, qs_ptr, C, SX,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)  # a row of the flat batch: no recurrence, every row in parallel
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = c < C
    s = tl.load(seq_ptr + t)
    start = tl.load(qs_ptr + s)
    base = state_ptr + s * (K - 1) * C
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(K):  # input t - (K - 1 - j) meets tap j
        i = t - (K - 1 - j)
        iv = c * 0 + i  # (the row index as a vector: masks combine per lane)
        from_x = tl.load(x_ptr + i * SX + c, mask=m & (iv >= start), other=0.0)
        # before the sequence's first row: its state's row K - 1 - (start - i)
        old = base + (K - 1 - (start - i)) * C + c
        from_state = tl.load(old, mask=m & (iv < start), other=0.0)
        acc += (from_x + from_state) * tl.load(w_ptr + c * K + j, mask=m, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + c, mask=m, other=0.0)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y_ptr + t * C + c, acc, mask=m)


@triton.jit
def _conv_state_kernel(x_ptr, state_ptr, qs_ptr, C, SX, K: tl.constexpr, BLOCK_C: tl.constexpr):
    s = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = c < C
    start = tl.load(qs_ptr + s)
    end = tl.load(qs_ptr + s + 1)
    base = state_ptr + s * (K - 1) * C
    # the last K - 1 inputs, older ones from the old state when the chunk is shorter. Row r
    # reads old row r + (end - start): written in increasing r, none is read once overwritten
    for r in tl.static_range(K - 1):
        i = end - (K - 1 - r)
        iv = c * 0 + i
        from_x = tl.load(x_ptr + i * SX + c, mask=m & (iv >= start), other=0.0)
        old = base + (K - 1 - (start - i)) * C + c
        from_state = tl.load(old, mask=m & (iv < start), other=0.0)
        tl.store(base + r * C + c, from_x + from_state, mask=m)


def conv_varlen_triton(x, weight, state, query_start, bias=None, silu: bool = False, seq=None):
    """Every sequence of a flat batch: x [T, C] (sequence b's rows query_start[b]..
    query_start[b + 1], int32 on the device; rows may be a column slice of wider rows), state
    [B, K - 1, C] float32 contiguous, updated in place -> y [T, C] float32 (bias, then SiLU when
    `silu`). Two launches: every row's output in parallel (the conv has no recurrence), then each
    sequence's new state. `seq`: each row's sequence, int32 [T] (`row_sequences`), if made
    already (once per step serves every layer)."""
    t, c = x.shape
    k = weight.shape[1]
    n_seq = state.shape[0]
    x = x.float()
    if x.stride(1) != 1:
        x = x.contiguous()
    w = weight.float().contiguous()
    y = torch.empty(t, c, dtype=torch.float32, device=x.device)
    if seq is None:
        seq = row_sequences(query_start, n_seq, t)
    block = min(128, triton.next_power_of_2(c))
    b = bias.float().contiguous() if bias is not None else w  # (unread without a bias)
    _conv_rows_kernel[(t, triton.cdiv(c, block))](x, w, b, state, y, seq, query_start, c,
                                                  x.stride(0), K=k, HAS_BIAS=bias is not None,
                                                  SILU=silu, BLOCK_C=block)  # fmt: skip
    _conv_state_kernel[(n_seq, triton.cdiv(c, block))](x, state, query_start, c, x.stride(0),
                                                       K=k, BLOCK_C=block)  # fmt: skip
    return y


def row_sequences(query_start: torch.Tensor, n_seq: int, t: int) -> torch.Tensor:
    """Each of a flat batch's T rows' sequence, int32 [T], from the device offsets."""
    seqs = torch.arange(n_seq, dtype=torch.int32, device=query_start.device)
    return torch.repeat_interleave(seqs, query_start.diff(), output_size=t)


@triton.jit
def _ssd_varlen_kernel(
    x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, state_ptr, y_ptr, qs_ptr,
    H, P, N, HEADS_PER_GROUP, G,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    sh = tl.program_id(0)  # sequence * H + head
    s = sh // H
    h = sh % H
    g = h // HEADS_PER_GROUP
    p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    mp, mn = p < P, n < N
    m2 = mp[:, None] & mn[None, :]
    offs = sh * P * N + p[:, None] * N + n[None, :]
    st = tl.load(state_ptr + offs, mask=m2, other=0.0)  # the state stays in registers
    a = tl.load(a_ptr + h)
    start = tl.load(qs_ptr + s)
    end = tl.load(qs_ptr + s + 1)
    for t in range(start, end):
        dt = tl.load(dt_ptr + t * H + h)
        bv = tl.load(b_ptr + (t * G + g) * N + n, mask=mn, other=0.0)
        cv = tl.load(c_ptr + (t * G + g) * N + n, mask=mn, other=0.0)
        xv = tl.load(x_ptr + (t * H + h) * P + p, mask=mp, other=0.0)
        st = st * tl.exp(dt * a) + (dt * xv)[:, None] * bv[None, :]
        tl.store(y_ptr + (t * H + h) * P + p, tl.sum(st * cv[None, :], axis=1), mask=mp)
    tl.store(state_ptr + offs, st, mask=m2)


def ssd_varlen_triton(x, dt, A, B, C, state, query_start) -> torch.Tensor:
    """Every sequence of a flat batch scanned in one launch, token by token with the state in
    registers: x [T, H, P], dt [T, H], A [H], B and C [T, G, N] (sequence b's rows
    query_start[b]..query_start[b + 1], int32 on the device), state [B, H, P, N] float32
    contiguous, updated in place. Returns y [T, H, P] float32 (as `ssd.ssd_scan` per sequence)."""
    t, h, p = x.shape
    g, n = B.shape[1], B.shape[2]
    x, dt, a = x.float().contiguous(), dt.float().contiguous(), A.float().contiguous()
    b, c = B.float().contiguous(), C.float().contiguous()
    y = torch.empty(t, h, p, dtype=torch.float32, device=x.device)
    block_n = triton.next_power_of_2(n)
    block_p = max(1, min(triton.next_power_of_2(p), 4096 // block_n))
    grid = (state.shape[0] * h, triton.cdiv(p, block_p))
    _ssd_varlen_kernel[grid](x, dt, a, b, c, state, y, query_start, h, p, n, h // g, g,
                             BLOCK_P=block_p, BLOCK_N=block_n)  # fmt: skip
    return y
