"""Dequant references for the ternary types TQ1_0 (base-3 packed, 1.69 bpw) and TQ2_0 (2-bit).

Same float32 operation order as gguf-py's numpy code, so results match it bit for bit.
"""

import torch

from localllm.kernels.quant.blocks import f16, split_bits


def _trits(x: torch.Tensor, n_digits: int) -> torch.Tensor:
    # A byte holds 5 (or 4) trits as a fixed-point fraction: multiplying by 3^i (mod 256) brings
    # digit i to the top, and (v * 3) >> 8 reads it out.
    pow3 = torch.tensor([1, 3, 9, 27, 81][:n_digits], dtype=torch.int32, device=x.device)
    v = (x.to(torch.int32).unsqueeze(1) * pow3.view(1, -1, 1)) & 0xFF
    return v.reshape(x.shape[0], -1)


def tq1_0(b: torch.Tensor) -> torch.Tensor:
    qs = torch.cat([_trits(b[:, 0:32], 5), _trits(b[:, 32:48], 5), _trits(b[:, 48:52], 4)], dim=-1)
    q = ((qs * 3) >> 8) - 1
    return f16(b, 52) * q.float()


def tq2_0(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    q = split_bits(b[:, 0:64].reshape(n, 2, 32), (0, 2, 4, 6), 3, dim=2).reshape(n, 256)
    return f16(b, 64) * (q.to(torch.int8) - 1).float()
