"""The GPU side of a handshake with the host inside one CUDA graph: flags in page-locked host
memory the GPU writes (`signal`) and waits on (`wait`), in stream order.

A decode step whose layers hand work to the CPU used to end a graph piece at each hand-over and
let the host launch the next one once its share was done: a driver call, a graph launch and
Python between the CPU's last store and the GPU's next kernel, every layer. Here the step is one
graph: a one-program kernel stores the step's sequence number into the layer's host flag after
the copies the CPU reads (their completion precedes it in stream order), and another spins on
the CPU's flag (volatile loads: system scope, they reach host memory every time) before the
copies back. The sequence number is a device scalar written before each replay, so a replay
never matches a flag of the one before.

A wait gives up after `SPIN_LIMIT` rounds (~1 s: a host that died must not hang the GPU) and
counts that in `errors[0]`; `waits[i]` counts the steps in which slot i had to wait at all (the
CPU was the longer side). The host side is `kernels/cpu/moe_gemv.c`'s `flag_wait` / `flag_set`.
Imported only where CUDA exists (or under TRITON_INTERPRET=1 in tests).
"""

import torch
import triton
import triton.language as tl

SPIN_LIMIT = 1 << 20  # rounds of ~1 us (one read over the bus each): about a second


@triton.jit
def _signal(flag_ptr, seq_ptr):
    tl.store(flag_ptr, tl.load(seq_ptr))


@triton.jit
def _wait(flag_ptr, seq_ptr, waits_ptr, errors_ptr, LIMIT: tl.constexpr):
    want = tl.load(seq_ptr)
    seen = tl.load(flag_ptr, volatile=True)
    n = 0
    while (seen != want) & (n < LIMIT):
        seen = tl.load(flag_ptr, volatile=True)
        n += 1
    if n > 0:
        tl.store(waits_ptr, tl.load(waits_ptr) + 1)
    if seen != want:
        tl.atomic_add(errors_ptr, 1)


def signal(flags: torch.Tensor, i: int, seq: torch.Tensor) -> None:
    """flags[i] = seq[0] (flags: an int32 view of host memory the GPU can write; seq: int32 [1]
    on the device)."""
    _signal[(1,)](flags[i:], seq)


def wait(
    flags: torch.Tensor,
    i: int,
    seq: torch.Tensor,
    waits: torch.Tensor,
    errors: torch.Tensor,
    limit: int = SPIN_LIMIT,
) -> None:
    """Hold the stream until flags[i] == seq[0] (or `limit` rounds: errors[0] += 1); waits[i] += 1
    when it was not so at once."""
    _wait[(1,)](flags[i:], seq, waits[i:], errors, LIMIT=limit)
