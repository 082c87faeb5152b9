"""Grouped expert FFN: y[t] = sum_j w[t, j] * down_e(act(gate_e(x[t])) * up_e(x[t])), e = ids[t, j].

Expert weights stay in their ggml encoding, one raw-block slice per expert (the GGUF stores each
`ffn_*_exps` tensor as [n_expert, rows, row_bytes], so an expert's slice is contiguous). The
grouped path gathers the tokens routed to each selected expert, asks `fetch(e)` for that
expert's blocks (a view of resident memory or a streamed slot) and dequantizes only those
experts. On the CPU `fetch` may instead answer with a `PreparedExpert` (kernels.moe.prepared:
weights prepared once, multiplied with `.matmul`, never dequantized per use).
`expert_ffn_reference` is the dense oracle: every expert on every token, masked, raw blocks.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from localllm.kernels.quant.dequant import dequantize
from localllm.kernels.quant.linear import TRITON_TYPES
from localllm.kernels.quant.linear_native import current_prompt_rows, prompt_rows
from localllm.kernels.quant.types import QuantType


class PreparedFFN(Protocol):
    """What the FFN needs of an expert's prepared weights (`kernels.moe.prepared` makes them,
    importing this module, so they are named by shape here): three linears with `.matmul`."""

    gate: Any
    up: Any
    down: Any


@dataclass(frozen=True, slots=True)
class ExpertFormat:
    """ggml types of one layer's gate/up/down expert tensors and the FFN sizes."""

    gate: QuantType
    up: QuantType
    down: QuantType
    dim: int
    hidden: int
    act: str = "silu"  # "silu" (SwiGLU), "gelu" (tanh GeGLU) or "swiglu_oai" (gpt-oss)


@dataclass(frozen=True, slots=True)
class ExpertBiases:
    """Per-expert biases (gpt-oss): gate and up [n_expert, hidden], down [n_expert, dim]."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


@dataclass(frozen=True, slots=True)
class ExpertBlocks:
    """Raw ggml blocks of one expert: gate and up [hidden, row_bytes], down [dim, row_bytes]."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


SWIGLU_OAI_LIMIT, SWIGLU_OAI_ALPHA = 7.0, 1.702
GEMV_MAX_M = 8  # rows up to which a CUDA expert uses the fused GEMV (as `triton_linear`)
# A prepared expert's prompt rows below this many take the native block linears' int8 rows (one
# pass over the weights) instead of their prompt GEMM, which decodes the weights for its int16
# tiles: as the fused expert kernels' GEMM_MIN_ROWS (kernels/cpu/moe_prompt.py). gpt-oss-20b
# shape, 64-token prompts (~8 rows an expert), 2 threads, 2026-12-06: 35-38 against 18-19 t/s
# (tests/perf/results/cpu-moe.md). A prompt row's bits then depend on how many rows share its
# expert in the call, as with the fused kernels.
PROMPT_GEMM_MIN_ROWS = 16


def _glu(g: torch.Tensor, u: torch.Tensor, act: str) -> torch.Tensor:
    if act == "swiglu_oai":  # gpt-oss: clamped, sigmoid(alpha * g) gate, (up + 1)
        g = g.clamp(max=SWIGLU_OAI_LIMIT)
        u = u.clamp(-SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT)
        return g * torch.sigmoid(SWIGLU_OAI_ALPHA * g) * (u + 1)
    return (F.silu(g) if act == "silu" else F.gelu(g, approximate="tanh")) * u


def _matrix(blocks: torch.Tensor, qtype: QuantType, rows: int, cols: int) -> torch.Tensor:
    return dequantize(blocks, qtype).reshape(rows, cols)


def _project(x: torch.Tensor, blocks: torch.Tensor, qtype: QuantType, rows: int, cols: int):
    """x @ W.T for one expert matrix: on CUDA, a few rows go through the triton GEMV over the raw
    blocks (no dequantized copy); otherwise the matrix is dequantized for this call."""
    if x.is_cuda and x.shape[0] <= GEMV_MAX_M and qtype in TRITON_TYPES:
        from localllm.kernels.quant.triton_linear import gemv

        return gemv(x, blocks.reshape(rows, -1), qtype, rows, cols)
    return x @ _matrix(blocks, qtype, rows, cols).T


def expert_ffn_one(
    x: torch.Tensor,
    b: "ExpertBlocks | PreparedFFN",
    fmt: ExpertFormat,
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One expert's FFN on the tokens x [n, dim] routed to it -> [n, dim] (float32); `b` is its
    raw blocks or its prepared weights (CPU); `bias` its (gate, up, down) biases, if any."""
    few = x.shape[0] < PROMPT_GEMM_MIN_ROWS and current_prompt_rows() is not False
    if few and not isinstance(b, ExpertBlocks):
        with prompt_rows(False):  # a prompt's few rows: the int8 rows, not the prompt GEMM
            return _ffn_one(x, b, fmt, bias)
    return _ffn_one(x, b, fmt, bias)


def _ffn_one(x: torch.Tensor, b, fmt: ExpertFormat, bias) -> torch.Tensor:
    d, h = fmt.dim, fmt.hidden
    if isinstance(b, ExpertBlocks):
        g = _project(x, b.gate, fmt.gate, h, d)
        u = _project(x, b.up, fmt.up, h, d)
    else:
        g, u = b.gate.matmul(x), b.up.matmul(x)
    if bias is not None:
        g, u = g + bias[0], u + bias[1]
    a = _glu(g, u, fmt.act)
    y = _project(a, b.down, fmt.down, d, h) if isinstance(b, ExpertBlocks) else b.down.matmul(a)
    return y + bias[2] if bias is not None else y


def _bias(biases: ExpertBiases | None, e: int):
    return None if biases is None else (biases.gate[e], biases.up[e], biases.down[e])


def group_by_expert(ids: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]]:
    """Order (token, choice) pairs by expert: (flat pair indices sorted by expert, the experts
    present in ascending order, how many pairs each has)."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    return order, experts.tolist(), counts.tolist()


def expert_ffn_grouped(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    fetch: "Callable[[int], ExpertBlocks | PreparedFFN]",
    fmt: ExpertFormat,
    biases: ExpertBiases | None = None,
) -> torch.Tensor:
    """x [T, dim], routing weights/ids [T, k] -> [T, dim]; touches only the selected experts.

    `fetch(e)` is called once per selected expert, in ascending order, and its blocks (raw or
    prepared) are used before the next call, so a streaming cache may reuse one slot for the
    next expert.
    """
    x = x.float()
    k = ids.shape[-1]
    order, experts, counts = group_by_expert(ids)
    tokens = order // k
    w = weights.reshape(-1)[order].float()
    out = torch.zeros_like(x)
    start = 0
    for e, n in zip(experts, counts, strict=True):
        sel = tokens[start : start + n]
        y = expert_ffn_one(x[sel], fetch(e), fmt, _bias(biases, e))
        # index_put_ over index_add_: same sums (a token meets each expert once) and ~50x less
        # dispatch overhead on CPU for the few rows of a decode step
        out.index_put_((sel,), y * w[start : start + n, None], accumulate=True)
        start += n
    return out


def expert_ffn_reference(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    fmt: ExpertFormat,
    biases: ExpertBiases | None = None,
) -> torch.Tensor:
    """The oracle: every expert on every token, weighted by a dense [T, E] routing matrix.

    gate/up/down are whole [n_expert, rows, row_bytes] raw tensors.
    """
    x = x.float()
    n_expert = gate.shape[0]
    dense = torch.zeros(x.shape[0], n_expert, dtype=torch.float32)
    dense.scatter_add_(1, ids, weights.float())
    out = torch.zeros_like(x)
    for e in range(n_expert):
        y = expert_ffn_one(x, ExpertBlocks(gate[e], up[e], down[e]), fmt, _bias(biases, e))
        out += dense[:, e : e + 1] * y
    return out
