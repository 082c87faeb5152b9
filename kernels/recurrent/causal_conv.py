"""The causal depthwise short convolution of recurrent layers (Gated DeltaNet's q/k/v conv; Mamba's
x conv): plain-torch references of the prompt (prefill) form and the decode step, carrying a
per-sequence state of the last K - 1 inputs across calls.

Channel c of token t is sum_j w[c, j] x[t - K + 1 + j, c] (the newest input meets the last tap),
inputs before the first token are the state's, or zeros for a new sequence: what
`torch.nn.Conv1d(groups=C, padding=K - 1)` computes, cut to the first T outputs.
"""

import torch
import torch.nn.functional as F


def causal_conv_prefill(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, silu: bool = True
) -> torch.Tensor:
    """One sequence: x [T, C], weight [C, K], state [K - 1, C] (oldest input first), replaced by
    the last K - 1 inputs seen. Returns y [T, C] float32 (SiLU applied when `silu`)."""
    k = weight.shape[1]
    full = torch.cat((state.float(), x.float()))  # [K - 1 + T, C]
    y = F.conv1d(full.t()[None], weight.float()[:, None, :], groups=weight.shape[0])[0].t()
    state.copy_(full[full.shape[0] - (k - 1) :])
    return F.silu(y) if silu else y


def causal_conv_step(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, silu: bool = True
) -> torch.Tensor:
    """One token of B sequences: x [B, C], state [B, K - 1, C] updated in place. Returns y [B, C]
    float32."""
    full = torch.cat((state.float(), x.float()[:, None, :]), dim=1)  # [B, K, C]
    y = (full * weight.float().t()[None]).sum(1)
    state.copy_(full[:, 1:])
    return F.silu(y) if silu else y
