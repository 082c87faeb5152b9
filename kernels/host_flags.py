"""The GPU side of a handshake with the host inside one CUDA graph, in stream order: a split
layer's hand-over (`engine.moe.split_link`) through flags in page-locked host memory.

A decode step whose layers hand work to the CPU used to end a graph piece at each hand-over and
let the host launch the next one once its share was done: a driver call, a graph launch and
Python between the CPU's last store and the GPU's next kernel, every layer. Here the step is one
graph and each hand-over is two kernels. `hand_out` stores the token rows and the CPU's routing
straight into mapped host memory, then (after a barrier and a system-scope release) the step's
sequence number into the layer's GPU flag; `take_back` spins on the CPU's flag (volatile loads:
system scope, they reach host memory every time), then adds the CPU's sum, read over the bus, to
the GPU's. They replaced three copies and a signal kernel, and a wait kernel, a copy back and an
add: each node left out was a launch between the CPU's last store and the next layer's first
kernel. The sequence number is a device scalar written before each replay, so a replay never
matches a flag of the one before.

A wait gives up after `SPIN_LIMIT` rounds (~1 s: a host that died must not hang the GPU) and
counts that in `errors[0]`; `waits[i]` counts the steps in which layer i had to wait at all (the
CPU was the longer side). The host side is `kernels/cpu/moe_gemv.c`'s `flag_wait` / `flag_set`.
Imported only where CUDA exists (or under TRITON_INTERPRET=1 in tests).
"""

import torch
import triton
import triton.language as tl

SPIN_LIMIT = 1 << 20  # rounds of ~1 us (one read over the bus each): about a second


# sizes and the layer's index are not specialized on: one compile serves every layer and step
@triton.jit(do_not_specialize=["T", "D", "K", "G", "sx", "sw", "si", "i"])
def _hand_out(x_ptr, w_ptr, ids_ptr, rows_ptr, cw_ptr, cids_ptr, flags_ptr, i, seq_ptr,
              T, D, K, G, sx, sw, si, BLOCK: tl.constexpr):  # fmt: skip
    for r in range(T):
        for d0 in range(0, D, BLOCK):
            o = d0 + tl.arange(0, BLOCK)
            m = o < D
            tl.store(rows_ptr + r * D + o, tl.load(x_ptr + r * sx + o, mask=m), mask=m)
    c = K - G
    for p0 in range(0, T * c, 64):
        o = p0 + tl.arange(0, 64)
        m = o < T * c
        row, j = o // c, G + o % c
        tl.store(cw_ptr + o, tl.load(w_ptr + row * sw + j, mask=m), mask=m)
        tl.store(cids_ptr + o, tl.load(ids_ptr + row * si + j, mask=m), mask=m)
    tl.debug_barrier()  # every thread's stores, then the flag released at system scope
    tl.atomic_xchg(flags_ptr + i, tl.load(seq_ptr), sem="release", scope="sys")


@triton.jit(do_not_specialize=["i", "N"])
def _take_back(yg_ptr, y_ptr, out_ptr, flags_ptr, i, seq_ptr, waits_ptr, errors_ptr, N,
               LIMIT: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    want = tl.load(seq_ptr)
    seen = tl.load(flags_ptr + i, volatile=True)
    n = 0
    while (seen != want) & (n < LIMIT):
        seen = tl.load(flags_ptr + i, volatile=True)
        n += 1
    pid = tl.program_id(0)
    if (n > 0) & (pid == 0):
        tl.store(waits_ptr + i, tl.load(waits_ptr + i) + 1)
    if seen != want:
        tl.atomic_add(errors_ptr, 1)
    o = pid * BLOCK + tl.arange(0, BLOCK)
    m = o < N
    # volatile: read from host memory after the flag, never from a cached line
    y = tl.load(y_ptr + o, mask=m, volatile=True)
    tl.store(out_ptr + o, tl.load(yg_ptr + o, mask=m).to(tl.float32) + y, mask=m)


def hand_out(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    g: int,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    flags: torch.Tensor,
    i: int,
    seq: torch.Tensor,
) -> None:
    """rows[:] = x, cw[:] = weights[:, g:], cids[:] = ids[:, g:] (`out` = (rows, cw, cids):
    contiguous mapped views, cast on store), then flags[i] = seq[0] once they are visible to the
    host. x [T, D], weights / ids [T, K]; one program."""
    rows, cw, cids = out
    x, weights, ids = x.contiguous(), weights.contiguous(), ids.contiguous()
    t, d = x.shape
    k = ids.shape[1]
    _hand_out[(1,)](x, weights, ids, rows, cw, cids, flags, i, seq, t, d, k, g,
                    x.stride(0), weights.stride(0), ids.stride(0), BLOCK=1024)  # fmt: skip


def take_back(
    yg: torch.Tensor,
    y: torch.Tensor,
    flags: torch.Tensor,
    i: int,
    seq: torch.Tensor,
    waits: torch.Tensor,
    errors: torch.Tensor,
    limit: int = SPIN_LIMIT,
) -> torch.Tensor:
    """Once flags[i] == seq[0]: yg + y, float32 (y: a contiguous mapped view the host wrote,
    read over the bus; yg: the GPU's sum). waits[i] += 1 when the flag did not hold it at once;
    after `limit` rounds without it, errors[0] += 1 and the sum takes y as it is."""
    out = torch.empty(yg.shape, dtype=torch.float32, device=yg.device)
    n, block = yg.numel(), 2048
    _take_back[(triton.cdiv(n, block),)](yg.contiguous(), y, out, flags, i, seq, waits, errors,
                                         n, LIMIT=limit, BLOCK=block)  # fmt: skip
    return out
