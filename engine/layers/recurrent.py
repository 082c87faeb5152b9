"""Recurrent ops over a flat token batch: each sequence's rows meet its own state slot.

A step's tokens are laid out flat (`BatchMeta.query_start`); a recurrent layer reads every
sequence's state (`engine.runtime.recurrent_state`, zeros for a sequence starting at position
0), runs the decode step over all sequences at once when each brings one token, else each
sequence's rows through the prefill form from its state, and writes the states back. Chunked
prefill therefore carries the state across chunks with nothing else to do.
"""

import torch

from localllm.engine.core.batch import BatchMeta
from localllm.engine.runtime.recurrent_state import states_of
from localllm.kernels.recurrent.causal_conv import causal_conv_prefill, causal_conv_step
from localllm.kernels.recurrent.ssd import ssd_chunked, ssd_step


def _one_token_each(batch: BatchMeta) -> bool:
    return batch.query_start[-1] == batch.num_seqs


def _rows(batch: BatchMeta):
    qs = batch.query_start
    return [(b, qs[b], qs[b + 1]) for b in range(batch.num_seqs)]


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
    state = st.read(layer, name, batch)  # [B, K - 1, C]
    if _one_token_each(batch) and x.is_cuda:  # one launch, bias and SiLU fused
        from localllm.kernels.recurrent.triton_step import conv_step_triton  # (no triton on CPU)

        y = conv_step_triton(x, weight, state, bias, silu)
        st.write(layer, name, batch, state)
        return y
    if _one_token_each(batch):
        y = causal_conv_step(x, weight, state, silu=False)
    else:
        y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        for b, s, e in _rows(batch):
            y[s:e] = causal_conv_prefill(x[s:e], weight, state[b], silu=False)
    st.write(layer, name, batch, state)
    if bias is not None:
        y = y + bias
    return torch.nn.functional.silu(y) if silu else y


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
    state = st.read(layer, name, batch)  # [B, H, P, N]
    if _one_token_each(batch):
        y = ssd_step(x, dt, A, B, C, state)
    else:
        y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        for b, s, e in _rows(batch):
            y[s:e] = ssd_chunked(x[s:e], dt[s:e], A, B[s:e], C[s:e], state[b])
    st.write(layer, name, batch, state)
    return y
