"""Linears on the CPU through the native kernels (`kernels/cpu/block_linear.c`), holding the
file's blocks alone: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4, IQ4_XS, Q4_K, Q5_K and Q6_K
(keep-quant: the fp16 copies or per-call dequantized tiles they replace took 2 or 4 bytes a weight,
the int4pack forms 0.875 plus scales). A fused
projection (q/k/v, gate/up) keeps its tensors as parts where the file has them, never stacked.

Q4_K / Q6_K / Q8_0 calls of up to NATIVE_MAX_T rows multiply int8 activations (per 256 values
for Q4_K, per 32 for the others, as llama.cpp's decode does; the native decode step does so for
every type) and read each weight row once for all rows. The other types' calls, and longer
ones of those three (prompts), decode row tiles to ggml's float32 values in C for an exact fp32
GEMM (tests/perf/results/cpu-moe.md, "CPU-only MoE next to llama.cpp") with PROMPT_I16 off,
or by default multiply int16 activations (`kernels/cpu/i16_gemm.h`; cpu.md for its figures).
`block_rows_reference` is the torch reference of the int8 path, `gemm_i16_reference` of the
int16 one, `quant_matmul_reference` (kernels/quant/linear.py) of the exact ones.

Row counts decide only for decode rows: inside `prompt_rows` (the engine's steps, from
`BatchMeta.prompt`) a step's prompt rows take the prompt GEMM whatever their count, so a prompt
token's bits do not depend on how its prompt was chunked or cached.
"""

import contextlib
import contextvars

import torch
import torch.nn.functional as F

from localllm.kernels.quant.dequant import dequantize
from localllm.kernels.quant.tiles import row_tiles
from localllm.kernels.quant.types import QuantType

# the types `kernels/cpu/block_linear.c` multiplies (this module never imports it: the kernels
# object comes from the loader, so importing kernels.quant never builds or loads C)
NATIVE_TYPES = frozenset(
    QuantType[n]
    for n in (
        "Q4_0",
        "Q4_1",
        "Q5_0",
        "Q5_1",
        "Q8_0",
        "IQ4_NL",
        "MXFP4",
        "IQ4_XS",
        "Q4_K",
        "Q5_K",
        "Q6_K",
    )
)
MAX_PARTS = 8  # parts of one weight (MAX_PARTS in the C)
# Rows per call on the int8 kernels (decode, batched decode, short prompts). This 2-core Xeon, one
# 4608 x 2048 / 2048 x 4096 matrix, ms per call at 16 / 32 / 64 / 96 rows: Q4_K int8 rows 1.86 /
# 3.64 / 7.15 / 10.64 against C-decoded tiles + fp32 GEMM 1.84* / 7.68 / 9.07 / 9.93 (*: rows);
# Q6_K 2.17 / 4.19 / 8.07 / 12.91 against 11.30 / 11.90 / 15.78 at 32 / 64 / 96.
NATIVE_MAX_T = 64
# The types new to these kernels (their torch paths before: an int4pack form at ~3e-3 relative
# error, fp16 copies at ~3e-4) take the int8 rows up to DECODE_ROWS rows (decode, batched
# decode), and none at all in a model whose decode steps the native decode step runs
# (`engine/layers/native_decode.py` sets `int8_max_t` to 0): calls here are then prompts,
# scoring and the steps it declines, which keep exact float32 math (tiles and a GEMM). Int8 rows
# up to 64 put llama.cpp's token 0.65 nats below our best on one of SmolLM2 Q4_1's
# teacher-forced golden prompts, of 53 tokens (the limit is 0.5).
# Calls of fewer than GEMM_MIN_ROWS rows are padded to that many for the GEMM: its rows' bits
# then do not depend on the call's other rows (MKL takes other kernels for a few rows), so a
# prompt alone and batched with others leave the same KV cache; int8 decode steps would turn
# any difference there into ~0.3-nat ones (tests/engine/test_engine_batching.py).
INT8_TYPES = frozenset({QuantType.Q4_K, QuantType.Q6_K, QuantType.Q8_0})
DECODE_ROWS = 16
GEMM_MIN_ROWS = 16
# True: calls past the int8 rows (prompts) take int16 activations (per 32 values, 1.5e-5 of each
# group's largest value, 3e-5 for Q6_K: `kernels/cpu/i16_gemm.h`), integer sums at twice the fp32
# FMA's rate: pp512 1.6-1.9x the exact fp32 tiles on Llama-3.2-1B / Gemma 3 270M Q4_K_M
# (tests/perf/results/cpu.md); a row's bits do not depend on the call's other rows either.
# Against llama.cpp's teacher-forced logits the mean KL is the exact path's to 6 digits; one
# Gemma 3 token of 1,469 flips at a 2e-4-nat tie (tests/engine/test_real_models.py counts such
# ties apart). On by default since prompt rows take one path whatever their chunk (issue 39,
# `prompt_rows`, tests/engine/test_prompt_rows.py): before, a completion and a chat request of
# one prompt answered differently (tests/app/server/test_chat_continue.py), the second's tail
# recomputed after a prefix-cache hit on other math. False: the exact float32 tiles.
# `NativeLinear.prompt_i16` sets it per weight.
PROMPT_I16 = True
# True: those calls take int8 activations in llama.cpp's format of each type instead (Q8_K, Q8_0
# or Q8_1: `kernels/cpu/i8_gemm.h`, `kernels/quant/prompt_i8.py`), `vpdpbusd` at twice int16's
# rate; each product is llama.cpp's own to float rounding, yet a model's teacher-forced logits
# land further from llama.cpp's, not nearer (likely: rounding flips compound over layers): off by
# default (tests/perf/results/cpu.md). `NativeLinear.prompt_i8` sets it per weight.
PROMPT_I8 = False


# The current step's prompt rows: False (none: the row-count rule), True (all) or a bool [T]
# over the step's flat rows (a step mixing both; calls of another row count, e.g. a subset of
# the rows, keep the row-count rule)
_PROMPT_ROWS: contextvars.ContextVar = contextvars.ContextVar("prompt_rows", default=False)


def current_prompt_rows() -> "bool | torch.Tensor":
    """The current step's prompt rows, as `prompt_rows` set them (False where none did)."""
    return _PROMPT_ROWS.get()


@contextlib.contextmanager
def prompt_rows(rows: "bool | torch.Tensor"):
    """Calls inside take the prompt GEMM for `rows` (`BatchMeta.prompt_mask`)."""
    token = _PROMPT_ROWS.set(rows)
    try:
        yield
    finally:
        _PROMPT_ROWS.reset(token)


class NativeLinear:
    kind = "native"

    def __init__(self, parts: list[torch.Tensor], qtype: QuantType, shape: tuple[int, int],
                 kernels):  # fmt: skip
        """`kernels`: a `kernels.cpu.block_linear.BlockKernels`."""
        # the mmap views as they are: no copy (contiguous rows of raw blocks)
        self.parts = kernels.parts([p.reshape(p.shape[0], -1) for p in parts])
        if self.parts.n != shape[0]:
            raise ValueError(f"parts of {self.parts.n} rows for a {shape} weight")
        self.qtype, self.shape, self.kernels = QuantType(qtype), shape, kernels
        # calls of up to this many rows take the int8 rows (see above)
        self.int8_max_t = NATIVE_MAX_T if self.qtype in INT8_TYPES else DECODE_ROWS
        self.prompt_i16 = PROMPT_I16 and hasattr(kernels, "gemm_i16")
        self.prompt_i8 = PROMPT_I8 and hasattr(kernels, "gemm_i8")

    @property
    def data(self) -> torch.Tensor:
        """The blocks of a one-part weight (tests, tools)."""
        return self.parts.parts[0]

    @property
    def nbytes(self) -> int:
        return sum(p.numel() for p in self.parts.parts)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.shape
        x2 = x.reshape(-1, k)
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.float().contiguous()
        rows = _PROMPT_ROWS.get()
        if rows is True:
            y = self._gemm(x2)
        elif isinstance(rows, torch.Tensor) and rows.numel() == x2.shape[0]:
            y = x2.new_empty(x2.shape[0], n)  # prompt and decode rows, each on its own path
            y[rows] = self._gemm(x2[rows])
            y[~rows] = self._decode(x2[~rows])
        else:
            y = self._decode(x2)
        return y.reshape(*x.shape[:-1], n)

    def _decode(self, x2: torch.Tensor) -> torch.Tensor:
        """Decode rows: the int8 rows up to `int8_max_t`, the prompt GEMM past that."""
        if x2.shape[0] <= self.int8_max_t:
            return self.kernels.rows(self.parts, self.qtype, self.shape[1], x2)
        return self._gemm(x2)

    def _gemm(self, x2: torch.Tensor) -> torch.Tensor:
        """Prompt rows [t, k] -> [t, n] (a row's bits do not depend on the other rows)."""
        n, k = self.shape
        t = x2.shape[0]
        if self.prompt_i8:
            y = self.kernels.gemm_i8(self.parts, self.qtype, k, x2)
        elif self.prompt_i16:
            y = self.kernels.gemm_i16(self.parts, self.qtype, k, x2)
        else:
            if t < GEMM_MIN_ROWS:
                x2 = torch.cat([x2, x2.new_zeros(GEMM_MIN_ROWS - t, k)])
            y = torch.empty(x2.shape[0], n)
            for r0, r1 in row_tiles(n, k):
                w = self.kernels.dequant(self.parts, self.qtype, k, r0, r1)
                y[:, r0:r1] = F.linear(x2, w)
            y = y[:t]
        return y


def activation_group(qtype: QuantType) -> int:
    """Values per int8 activation scale: 256 for Q4_K and Q5_K (llama.cpp's Q8_K), else 32."""
    return 256 if QuantType(qtype) in (QuantType.Q4_K, QuantType.Q5_K) else 32


def block_rows_reference(x: torch.Tensor, parts: list[torch.Tensor], qtype: QuantType,
                         k: int) -> torch.Tensor:  # fmt: skip
    """The int8 path's math in torch: x [t, k] rounded to int8 codes per `activation_group`
    (scale amax / 127, as the C), times the gguf-dequantized parts stacked, float64 [t, n]."""
    g = x.float().reshape(x.shape[0], -1, activation_group(qtype))
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(g * inv)  # lrintf: to nearest, ties to even
    xq = (q.double() * (amax / 127.0).double()).reshape(x.shape[0], k)
    w = torch.cat([dequantize(p, qtype).reshape(-1, k) for p in parts]).double()
    return xq @ w.T


def i16_qmax(qtype: QuantType) -> int:
    """The int16 activation codes' bound (`i16_qmax` in kernels/cpu/i16_gemm.h): Q6_K's codes
    carry their scales (up to 4096), so its sums of 32 stay in int32 only below 16384."""
    return 16383 if QuantType(qtype) == QuantType.Q6_K else 32767


def gemm_i16_reference(x: torch.Tensor, parts: list[torch.Tensor], qtype: QuantType,
                       k: int) -> torch.Tensor:  # fmt: skip
    """The int16 prompt path's math in torch: x [t, k] rounded to int16 codes per 32 values
    (scale amax / `i16_qmax`, float32 as the C), times the gguf-dequantized parts, float64
    [t, n]."""
    qmax = float(i16_qmax(qtype))
    g = x.float().reshape(x.shape[0], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, qmax) / amax,
                      torch.zeros_like(amax))  # fmt: skip
    q = torch.round(g * inv)
    xq = (q.double() * (amax / qmax).double()).reshape(x.shape[0], k)
    w = torch.cat([dequantize(p, qtype).reshape(-1, k) for p in parts]).double()
    return xq @ w.T
