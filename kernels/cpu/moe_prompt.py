"""Prompt rows of a CPU MoE layer through the int16 prompt GEMM (`kernels/cpu/i16_gemm.h`).

The decode kernels (`moe_gemv.c`'s `moe_pairs`) dot each expert's weight rows with its token
rows one or two at a time, decoding the weight codes again for every pair; a prompt's expert
takes 8-32 rows of a 256-512-token prompt, so that decode was paid 4-16 times a row. Here each
expert's gate | up and down run as GEMMs over its gathered rows (`block_gemm_i16`: the weights
decoded once a call, int16 activations per 32), the SwiGLU / GeGLU product between them in
float32, and `moe_combine` adds the choices in their fixed order. Experts with fewer than
`GEMM_MIN_ROWS` rows in the call keep the decode kernels, which are faster there.
"""

import ctypes
import itertools

import torch
import torch.nn.functional as F

from localllm.kernels.moe.experts import group_by_expert
from localllm.kernels.quant.types import QuantType

_P, _I = ctypes.c_void_p, ctypes.c_int64
# An expert's rows in one call from which its GEMMs beat the decode kernels (those decode the
# weight codes again for every pair of rows, the GEMM once a call): 6-layer Qwen3-30B-A3B shape,
# 2 threads, 2026-12-06: 4 rows an expert (pp64) 0.53x the decode kernels' speed, 16 (pp256)
# 1.17x, 32 (pp512) 1.32x. So an expert's prompt rows take the GEMM only from 16 rows, and a
# MoE prompt row's bits can depend on how many rows of its call share its expert.
GEMM_MIN_ROWS = 16


def _gemm(lib, qtype: QuantType, mats: list[torch.Tensor], k: int, x: torch.Tensor,
          threads: int) -> torch.Tensor:  # fmt: skip
    """x [t, k] . [mats stacked]^T -> [t, sum of their rows] (raw blocks, one ggml type)."""
    ptrs = (_P * len(mats))(*(m.data_ptr() for m in mats))
    rows = (_I * len(mats))(*(m.shape[0] for m in mats))
    y = torch.empty(x.shape[0], sum(m.shape[0] for m in mats))
    rc = lib.block_gemm_i16(int(qtype), len(mats), ptrs, rows, k, x.shape[0], x.data_ptr(),
                            y.data_ptr(), threads)  # fmt: skip
    if rc != 0:
        raise MemoryError(f"int16 expert GEMM of {x.shape[0]} x {k}: no memory")
    return y


def expert_prompt_pairs(lib, x: torch.Tensor, ids: torch.Tensor, fetch,
                        types: tuple[QuantType, QuantType, QuantType], act: str, threads: int,
                        at_once: int | None,
                        pairs_dn) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Each (token, choice) pair's expert output: x [T, dim] float32, ids [T, k]; `fetch` as
    `NativeKernels.moe_ffn_fetched`'s; `pairs_dn(tok, counts, blocks)` the decode kernels'
    outputs for experts of fewer than GEMM_MIN_ROWS rows. Returns (dn [pairs, dim] in expert-grouped
    order, pos [T * k]: each flat pair's row of dn) for `moe_combine`."""
    t, dim = x.shape
    kk = ids.shape[1]
    order, used, counts = group_by_expert(ids.to(torch.int64))
    bounds = [0, *itertools.accumulate(counts)]
    tok = order // kk
    pos = torch.empty_like(order)
    pos[order] = torch.arange(t * kk)
    dn = torch.empty(t * kk, dim)
    tg, tu, td = (QuantType(q) for q in types)
    step = at_once or len(used) or 1
    for c0 in range(0, len(used), step):
        chunk = used[c0 : c0 + step]
        blocks = fetch(chunk)
        few = [i for i in range(len(chunk)) if counts[c0 + i] < GEMM_MIN_ROWS]
        if few:
            spans = [(bounds[c0 + i], bounds[c0 + i + 1]) for i in few]
            out = pairs_dn(torch.cat([tok[a:b] for a, b in spans]), [b - a for a, b in spans],
                           [blocks[i] for i in few])  # fmt: skip
            at = 0
            for a, b in spans:
                dn[a:b], at = out[at : at + b - a], at + b - a
        for i, (gate, up, down) in enumerate(blocks):
            a, b = bounds[c0 + i], bounds[c0 + i + 1]
            if b - a < GEMM_MIN_ROWS:
                continue
            xe = x.index_select(0, tok[a:b])
            hidden = gate.shape[0]
            if tg == tu:  # gate | up in one call, as the dense layers' fused gate | up
                gu = _gemm(lib, tg, [gate, up], dim, xe, threads)
                g, u = gu[:, :hidden], gu[:, hidden:]
            else:
                g, u = (
                    _gemm(lib, tg, [gate], dim, xe, threads),
                    _gemm(lib, tu, [up], dim, xe, threads),
                )
            h = (F.silu(g) if act == "silu" else F.gelu(g, approximate="tanh")) * u
            dn[a:b] = _gemm(lib, td, [down], hidden, h.contiguous(), threads)
    return dn, pos.contiguous()
