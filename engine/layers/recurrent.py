"""Recurrent ops over a flat token batch: each sequence's rows meet its own state slot.

A step's tokens are laid out flat (`BatchMeta.query_start`). A decode step (one token per
sequence) steps each sequence's state slot in place through the slot indices
(`engine.runtime.recurrent_state`: no copy out and back, nothing that depends on the host, so a
CUDA graph captures it); any other step reads every sequence's state (zeros for a sequence
starting at position 0), runs the decode step once over the sequences that bring one token, each
longer one's rows through the prefill form from its state, and writes the states back. On CUDA a
decode step is one Triton launch, and so is any other step's whole batch
(`kernels.recurrent.triton_step`); with CHUNKED_MIN_ROWS lowered, a Mamba-2 prompt of that many
rows or more scans in chunks instead, three launches (`kernels.recurrent.triton_ssd_chunked`).
Chunked prefill therefore carries the state across chunks with nothing else to do, and a step
that mixes decodes with a prompt chunk still decodes in one call. A prompt CUDA graph
(`engine.runtime.prefill_graphs`) gives these layers its layout as device tensors
(`prompt_graph_plans`): nothing of it is read on the host, so one capture serves every chunk.
"""

from collections.abc import Callable

import torch

from localllm.engine.core.batch import BatchMeta
from localllm.engine.runtime.recurrent_state import STATE_FRESH, STATE_SLOTS, states_of
from localllm.kernels.recurrent.causal_conv import causal_conv_prefill, causal_conv_step
from localllm.kernels.recurrent.decode import mamba2_mixer_decode, short_conv_decode, ssd_decode
from localllm.kernels.recurrent.ssd import Mamba2Mixer, ssd_chunked, ssd_step

# A prompt's Mamba-2 scan on CUDA can run in chunks (`triton_ssd_chunked`: matmuls, three
# launches) once a sequence brings this many rows; other steps scan token by token in one launch
# (`triton_step.ssd_varlen_triton`). Off (1 << 30) by default: on an H100 (2026-12-06,
# tests/perf/gpu_hybrid_prefill.sh) Granite-4.0-H-Tiny's eager pp512 forward took 53.5 ms with
# the chunks at IEEE float32 against 51.0 ms token by token; the chunks at tf32x3 took 117 us a
# layer alone against 248 us token by token, not yet measured in the whole forward.
CHUNKED_MIN_ROWS = 1 << 30


def use_triton(x: torch.Tensor) -> bool:
    """Whether the decode step runs as a Triton launch: where CUDA does (a test sets it under
    TRITON_INTERPRET=1 to run the kernels through a model on CPU)."""
    return x.is_cuda


def _one_token_each(batch: BatchMeta) -> bool:
    """A decode step: every sequence brings one token (then the slots are stepped in place)."""
    return batch.query_start[-1] == batch.num_seqs


def _split(batch: BatchMeta) -> tuple[list[int], list[tuple[int, int, int]]]:
    """(sequences with one token, (sequence, first row, end row) of the others)."""
    qs = batch.query_start
    single = [b for b in range(batch.num_seqs) if qs[b + 1] - qs[b] == 1]
    longer = [(b, qs[b], qs[b + 1]) for b in range(batch.num_seqs) if qs[b + 1] - qs[b] > 1]
    return single, longer


def _run(
    batch: BatchMeta,
    state: torch.Tensor,
    out_shape: tuple[int, ...],
    device: torch.device,
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    prefill: Callable[[int, int, torch.Tensor], torch.Tensor],
    varlen: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """y [T, ...] of a step with a longer sequence: from `step(rows, states)` over the one-token
    sequences (their states updated in place) and `prefill(s, e, state)` over each longer one's
    rows s..e; or, given `varlen`, the whole batch in one call `varlen(query_start)` (int32
    offsets on the device)."""
    single, longer = _split(batch)
    if varlen is not None:
        key = ("query_start_i32",)
        if key not in batch.plans:
            qs = torch.tensor(batch.query_start, dtype=torch.int32)
            batch.plans[key] = qs.to(device)
        return varlen(batch.plans[key])
    y = torch.empty(out_shape, dtype=torch.float32, device=device)
    if single:
        qs = batch.query_start
        seqs = torch.tensor(single, device=device)
        rows = torch.tensor([qs[b] for b in single], device=device)
        sub = state.index_select(0, seqs)
        y[rows] = step(rows, sub)
        state.index_copy_(0, seqs, sub)
    for b, s, e in longer:
        y[s:e] = prefill(s, e, state[b])
    return y


def short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    batch: BatchMeta,
    kv,
    layer: int,
    name: str = "conv",
    bias: torch.Tensor | None = None,
    silu: bool = False,
) -> torch.Tensor:
    """The depthwise causal conv of x [T, C] with weight [C, K] (+ bias, then SiLU when `silu`)
    over each sequence's last K - 1 inputs (state `name`: [K - 1, C]) -> [T, C] float32."""
    st = states_of(kv)
    if _one_token_each(batch):  # in place on the slots
        states, slots, fresh = st.tensor(layer, name), st.slots(batch), st.fresh(batch)
        if use_triton(x):  # one launch, bias and SiLU fused
            from localllm.kernels.recurrent.triton_step import conv_step_triton  # (CUDA only)

            return conv_step_triton(x, weight, states, bias, silu, slots, fresh)
        return short_conv_decode(x, weight, states, slots, fresh, bias, silu)
    state = _read(st, layer, name, batch)  # [B, K - 1, C]

    def step(rows, sub):
        xs = x[rows]
        if use_triton(x):  # one launch, bias and SiLU fused
            from localllm.kernels.recurrent.triton_step import conv_step_triton  # (CUDA only)

            return conv_step_triton(xs, weight, sub, bias, silu)
        return _finish(causal_conv_step(xs, weight, sub, silu=False), bias, silu)

    def prefill(s, e, one):
        return _finish(causal_conv_prefill(x[s:e], weight, one, silu=False), bias, silu)

    varlen = None
    if use_triton(x):  # every sequence's rows in one launch
        from localllm.kernels.recurrent.triton_step import conv_varlen_triton

        def varlen(qs):
            key = ("row_sequences",)  # the same for every layer of the step
            if key not in batch.plans:
                from localllm.kernels.recurrent.triton_step import row_sequences

                batch.plans[key] = row_sequences(qs, batch.num_seqs, x.shape[0])
            return conv_varlen_triton(x, weight, state, qs, bias, silu, batch.plans[key])

    y = _run(batch, state, tuple(x.shape), x.device, step, prefill, varlen)
    st.write(layer, name, batch, state)
    return y


def gated_short_conv(
    bcx: torch.Tensor, weight: torch.Tensor, batch: BatchMeta, kv, layer: int, dtype: torch.dtype
) -> torch.Tensor:
    """LFM2's gated short conv: C * conv(B * x) from the in-projection's rows bcx [T, 3C] (B, C, x
    side by side) -> [T, C] in `dtype`. A CUDA decode step is one launch (the products fused
    into the conv step: no elementwise kernels around it); other steps run `short_conv`."""
    return gated_short_conv_q(bcx, weight, batch, kv, layer, dtype, quant=False)[0]


def gated_short_conv_q(
    bcx: torch.Tensor, weight: torch.Tensor, batch: BatchMeta, kv, layer: int,
    dtype: torch.dtype, quant: bool,
):  # fmt: skip
    """(`gated_short_conv`, its int8 rows for the out-projection's GEMV or None); a CUDA decode
    step with `quant` makes both in its one launch."""
    if use_triton(bcx) and _one_token_each(batch):
        from localllm.kernels.recurrent.triton_step import conv_step_triton  # (CUDA only)

        st = states_of(kv)
        states, slots, fresh = st.tensor(layer, "conv"), st.slots(batch), st.fresh(batch)
        step = {"slots": slots, "fresh": fresh, "gated": True, "out_dtype": dtype}
        if quant:
            return conv_step_triton(bcx, weight, states, **step, quant=True)
        return conv_step_triton(bcx, weight, states, **step), None
    b, c, x = bcx.split(weight.shape[0], dim=-1)
    return (c * short_conv(b * x, weight, batch, kv, layer)).to(dtype), None


def _read(st, layer: int, name: str, batch: BatchMeta) -> torch.Tensor:
    """`st.read`: the sequences' states [B, *shape]; zeros in one launch when every sequence
    starts at position 0 (a fresh prompt: nothing of its slots is read)."""
    qs = batch.query_start
    fresh = batch.context is None and all(
        qs[b + 1] - qs[b] == n for b, n in enumerate(batch.seq_lens)
    )
    if not fresh:
        return st.read(layer, name, batch)
    t = st.tensor(layer, name)
    return torch.zeros(batch.num_seqs, *t.shape[1:], dtype=t.dtype, device=t.device)


def _longest(batch: BatchMeta) -> int:
    qs = batch.query_start
    return max(qs[b + 1] - qs[b] for b in range(batch.num_seqs))


def _chunk_plan(batch: BatchMeta, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's chunk table for `ssd_chunked_triton` on the device, built once per step."""
    key = ("ssd_chunks",)
    if key not in batch.plans:
        from localllm.kernels.recurrent.triton_ssd_chunked import chunk_table

        rows, first = chunk_table(list(batch.query_start))
        both = torch.tensor(rows + first, dtype=torch.int32).to(device)  # one copy
        batch.plans[key] = (both[: len(rows)].view(-1, 2), both[len(rows) :])
    return batch.plans[key]


def prompt_graph_plans(batch: BatchMeta, kv, ctx: torch.Tensor) -> None:
    """Fill `batch.plans` for a prompt graph's padded rows [P] from `ctx` = [first position,
    end position, state slot] (int64 on the device, the graph's static input), with no host
    read: the chunk's n = end - first rows are sequence 0 on its slot (fresh at position 0), the
    padding rows after them sequence 1 on the scratch slot (fresh), so the scans stop the
    chunk's state at its last real row and the padding writes only scratch."""
    st = states_of(kv)
    p = batch.query_start[-1]
    n = ctx[1] - ctx[0]
    qs = torch.stack([torch.zeros_like(n), n, torch.full_like(n, p)])
    batch.plans[("query_start_i32",)] = qs.to(torch.int32)
    rows = torch.arange(p, device=ctx.device)
    batch.plans[("row_sequences",)] = (rows >= n).to(torch.int32)
    batch.plans[STATE_SLOTS] = torch.stack([ctx[2], torch.full_like(ctx[2], st.scratch)])
    batch.plans[STATE_FRESH] = torch.stack([ctx[0] == 0, torch.ones_like(ctx[0], dtype=torch.bool)])
    if p >= CHUNKED_MIN_ROWS:
        batch.plans[("ssd_chunks",)] = _device_chunks(n, p)


def _device_chunks(n: torch.Tensor, p: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`_chunk_plan` of the two sequences [0, n) and [n, p) from n on the device: a fixed
    ceil(p / L) + 1 chunks (L: the kernel's CHUNK), the first sequence's then the second's, its
    last one empty (p, p) where the two need one chunk fewer (an empty chunk leaves a state as
    it is)."""
    from localllm.kernels.recurrent.triton_ssd_chunked import CHUNK as L

    k = -(-p // L) + 1
    i = torch.arange(k, device=n.device)
    c0 = torch.div(n + L - 1, L, rounding_mode="floor")
    first = i * L
    second = torch.clamp(n + (i - c0) * L, max=p)
    starts = torch.where(i < c0, first, second)
    ends = torch.where(i < c0, torch.clamp(first + L, max=n), torch.clamp(second + L, max=p))
    chunks = torch.stack([starts, ends], 1).to(torch.int32)
    seq = torch.stack([torch.zeros_like(c0), c0, torch.full_like(c0, k)]).to(torch.int32)
    return chunks, seq


def _finish(y: torch.Tensor, bias: torch.Tensor | None, silu: bool) -> torch.Tensor:
    if bias is not None:
        y = y + bias
    return torch.nn.functional.silu(y) if silu else y


def mamba2_conv_dt(
    xbc: torch.Tensor, weight, bias, dt: torch.Tensor, dt_bias, batch: BatchMeta, kv, layer: int
):  # fmt: skip
    """Mamba-2's conv step (bias, SiLU; state "conv" in place on the slots) and softplus(dt +
    dt_bias) in one launch, where the step decodes one token a sequence through the Triton
    kernels (xbc and dt column slices of the in-projection's rows): (xbc', dt') float32, or
    None (the caller runs `short_conv` and the softplus)."""
    if not (use_triton(xbc) and _one_token_each(batch)):
        return None
    from localllm.kernels.recurrent.triton_step import conv_step_triton  # (CUDA only)

    st = states_of(kv)
    conv, slots, fresh = st.tensor(layer, "conv"), st.slots(batch), st.fresh(batch)
    return conv_step_triton(xbc, weight, conv, bias, True, slots, fresh, dt=dt, dt_bias=dt_bias)


def mamba2_decode(zxd: torch.Tensor, mixer: Mamba2Mixer, batch: BatchMeta, kv, layer: int):
    """Mamba-2's mixer between its projections in one native call (`kernels/cpu/recurrent_step.c`)
    where the step decodes one token a sequence on a CPU: zxd [T, Din + Cc + H] the in-projection's
    rows. Returns the out-projection's input [T, Din] float32, or None: then the caller runs
    `short_conv`, `ssd` and the gated norm (prompts, CUDA, no compiler)."""
    if use_triton(zxd) or not _one_token_each(batch):
        return None
    st = states_of(kv)
    conv, ssm = st.tensor(layer, "conv"), st.tensor(layer, "ssm")
    return mamba2_mixer_decode(zxd, mixer, conv, ssm, st.slots(batch), st.fresh(batch))


def ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    batch: BatchMeta,
    kv,
    layer: int,
    name: str = "ssm",
) -> torch.Tensor:
    """The Mamba-2 scan (`kernels.recurrent.ssd`) of x [T, H, P], dt [T, H], B and C [T, G, N]
    from each sequence's state `name` [H, P, N] -> y [T, H, P] float32 (no D skip, no gate)."""
    st = states_of(kv)
    if _one_token_each(batch):  # in place on the slots
        states, slots, fresh = st.tensor(layer, name), st.slots(batch), st.fresh(batch)
        if use_triton(x):
            from localllm.kernels.recurrent.triton_step import ssd_step_triton  # (CUDA only)

            return ssd_step_triton(x, dt, A, B, C, states, slots, fresh)
        return ssd_decode(x, dt, A, B, C, states, slots, fresh)
    state = _read(st, layer, name, batch)  # [B, H, P, N]

    def step(rows, sub):
        return ssd_step(x[rows], dt[rows], A, B[rows], C[rows], sub)

    def prefill(s, e, one):
        return ssd_chunked(x[s:e], dt[s:e], A, B[s:e], C[s:e], one)

    varlen = None
    if use_triton(x) and _longest(batch) >= CHUNKED_MIN_ROWS:  # chunks: matmuls, 3 launches
        from localllm.kernels.recurrent.triton_ssd_chunked import ssd_chunked_triton

        chunks, seq_chunks = _chunk_plan(batch, x.device)

        def varlen(qs):
            return ssd_chunked_triton(x, dt, A, B, C, state, chunks, seq_chunks)

    elif use_triton(x):  # every sequence's rows in one launch, the state in registers
        from localllm.kernels.recurrent.triton_step import ssd_varlen_triton

        def varlen(qs):
            return ssd_varlen_triton(x, dt, A, B, C, state, qs)

    y = _run(batch, state, tuple(x.shape), x.device, step, prefill, varlen)
    st.write(layer, name, batch, state)
    return y
