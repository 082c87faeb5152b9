"""Int4PackLinear: integer-code ggml weights repacked into torch's CPU int4 format.

The codes of Q4_0/Q4_1/Q4_K fit one int4 plane; Q5_0/Q5_1/Q5_K/Q8_0 codes are split into a
high and a low plane laid side by side along K (x is fed as [16 x, x]). Two paths:
- "bf16": `_weight_int4pack_mm_for_cpu` with bf16 activations and bf16 scale/zero (torch's fast
  AVX2 kernel; bf16 rounding of x and of the scales, about 3e-3 relative error);
- "exact": unpack row tiles to float32 w = a * code + b (bit-exact vs gguf dequant) and run an
  fp32 GEMM; on CPU this beats the bf16 kernel for long prompts, and it is the precise path.
Holds only the packed codes and per-32 scales (no copy of the raw blocks).
"""

import torch

from localllm.kernels.quant import int4pack
from localllm.kernels.quant.affine import CODE_BITS, affine_codes
from localllm.kernels.quant.tiles import row_tiles
from localllm.kernels.quant.types import QuantType

GROUP = 32
_ROWS_PER_CONVERT = 4096  # convert the raw blocks in row chunks: bounds load-time scratch


class Int4PackLinear:
    """y = x @ W.T for an integer-code ggml weight [N, K], kept as packed int4 planes."""

    def __init__(self, data: torch.Tensor, qtype: QuantType, shape: tuple[int, int], exact_from_t):
        n, k = shape
        if n % 16 or k % GROUP:
            raise ValueError(f"int4pack needs N % 16 == 0 and K % 32 == 0, got {shape}")
        self.qtype, self.shape = QuantType(qtype), (n, k)
        self.planes = 1 if CODE_BITS[self.qtype] == 4 else 2
        # Calls with at least this many rows take the exact fp32 path (0: always).
        self.exact_from_t = exact_from_t
        packed, sz, a_t, b_t = [], [], [], []
        for r0 in range(0, n, _ROWS_PER_CONVERT):
            codes, a, b = affine_codes(data[r0 : r0 + _ROWS_PER_CONVERT], self.qtype)
            packed.append(int4pack.pack(self._planes(codes)))
            sz.append(self._scale_zero(a, b))
            a_t.append(a.T)
            b_t.append(b.T)
        self.packed = torch.cat(packed)  # uint8 [N, planes * K / 2]
        self.sz_bf16 = torch.cat(sz, dim=1)  # bf16 [planes * K / 32, N, 2] as the op wants
        self.a_t = torch.cat(a_t, dim=1).contiguous()  # float32 [K / 32, N]
        self.b_t = torch.cat(b_t, dim=1).contiguous()

    @property
    def kind(self) -> str:
        return f"int4pack{self.planes}"

    @property
    def nbytes(self) -> int:
        ts = (self.packed, self.sz_bf16, self.a_t, self.b_t)
        return sum(t.numel() * t.element_size() for t in ts)

    def _planes(self, codes: torch.Tensor) -> torch.Tensor:
        if self.planes == 1:
            return codes
        return torch.cat([codes >> 4, codes & 0xF], dim=1)

    def _scale_zero(self, a: torch.Tensor, b: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
        # tinygemm decodes each plane as (q - 8) * scale + zero. One plane: zero = 8a + b.
        # Two planes, x fed as [16x, x]: 16 ((hi - 8) a + zh) + (lo - 8) a + zl = a code + b
        # needs zl = b + 136 a - 16 zh. zh is chosen so both zeros stay near the weights' size
        # (bf16 rounds them): Q8_0 (b = -128 a) takes zh = 0, the 5-bit types zh = 8 a.
        if self.planes == 1:
            sz = torch.stack([a, 8 * a + b], dim=-1)
        else:
            zh = torch.zeros_like(a) if CODE_BITS[self.qtype] == 8 else 8 * a
            hi = torch.stack([a, zh], dim=-1)
            lo = torch.stack([a, b + 136 * a - 16 * zh], dim=-1)
            sz = torch.cat([hi, lo], dim=1)
        return sz.transpose(0, 1).to(dtype).contiguous()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        # Few torch ops on the decode path: each costs ~5 us here, and a small model makes
        # hundreds of these calls per token.
        if x.dim() != 2:
            return self.matmul(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], self.shape[0])
        if x.shape[0] >= self.exact_from_t:
            return self.matmul_exact(x)
        return self.matmul_bf16(x)

    def matmul_bf16(self, x: torch.Tensor) -> torch.Tensor:
        xb = x.to(torch.bfloat16)
        if not xb.is_contiguous():
            xb = xb.contiguous()
        if self.planes == 2:
            xb = torch.cat([xb * 16, xb], dim=1)  # *16 is exact in bf16
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        return mm(xb, self.packed, GROUP, self.sz_bf16).float()

    def weight_t(self, r0: int, r1: int) -> torch.Tensor:
        """float32 W[r0:r1].T, [K, r1 - r0], equal to gguf's dequant (r0 a multiple of 64)."""
        k = self.shape[1]
        packed = self.packed[r0:r1]
        w = int4pack.unpack_float_t(packed, 0, k)
        if self.planes == 2:  # code = 16 hi + lo, exact in fp32
            w.mul_(16).add_(int4pack.unpack_float_t(packed, k, 2 * k))
        # a * code is exact in fp32 (<= 22 significant bits), so only the add rounds: the same
        # single rounding as gguf's dequant
        wg = w.view(k // GROUP, GROUP, r1 - r0)
        wg.mul_(self.a_t[:, None, r0:r1]).add_(self.b_t[:, None, r0:r1])
        return w

    def matmul_exact(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.shape
        x = x.float()
        if not int4pack.unpack_supported():
            return self._exact_slow(x)
        out = torch.empty(x.shape[0], n, dtype=torch.float32)
        for r0, r1 in row_tiles(n, k):
            out[:, r0:r1] = x @ self.weight_t(r0, r1)
        return out

    def _exact_slow(self, x: torch.Tensor) -> torch.Tensor:
        # unknown packed layout: torch's own fp32 kernel (scalar, slow, ~1e-7 relative error)
        sz = self._scale_zero(self.a_t.T, self.b_t.T, torch.float32)
        xs = torch.cat([x * 16, x], dim=1) if self.planes == 2 else x
        return torch.ops.aten._weight_int4pack_mm_for_cpu(xs.contiguous(), self.packed, GROUP, sz)
