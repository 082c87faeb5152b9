"""The CPU decode step of llama-family decoders as one native call (`kernels/cpu/decode_step`):
`NativeDecode.for_model` looks once whether a loaded model qualifies (llama blocks, dense gated
MLPs, no biases, every linear on the native block kernels) and `__call__` runs a step when it
does (each sequence's one new token, a float32 or float16 paged cache, no row on a LoRA
adapter), else answers None and the torch layers run. Steps of the same model give the same
tokens either way (tests/kernels/test_cpu_decode_step.py); the per-layer work is the same, the
~20 dispatched torch ops per layer are gone.
"""

import torch
from torch import nn

from localllm.engine.core.batch import BatchMeta
from localllm.engine.layers.shared import GatedMLP
from localllm.kernels.cpu import decode_step
from localllm.kernels.quant.linear_native import NativeLinear

MAX_ROWS = 16  # token rows per native step (batched decode); more: the torch layers
LLAMA_BLOCK = "localllm.engine.models.llama"


def _kernels(m: nn.Module | None) -> list | None:
    """The native kernels of a linear or fused linear, or None where any is not native."""
    if m is None:
        return None
    ks = m.kernels()
    return ks if ks and all(isinstance(k, NativeLinear) for k in ks) else None


class NativeDecode:
    def __init__(self, model: nn.Module, lib, shape: decode_step.Shape, parts: list[tuple]):
        self.model, self.lib, self.shape, self.parts = model, lib, shape, parts
        self._step: tuple[object, decode_step.DecodeStep] | None = None  # (kv, its step)

    @classmethod
    def for_model(cls, model: nn.Module) -> "NativeDecode | None":
        """The native step of `model`, or None where it does not qualify (or nothing builds)."""
        blocks = getattr(model, "blk", None)
        args = getattr(model, "args", None)
        if not blocks or args is None or getattr(args, "n_expert", 0):
            return None
        parts = []
        for blk in blocks:
            if type(blk).__module__ != LLAMA_BLOCK or not isinstance(blk.mlp, GatedMLP):
                return None
            qkv = _kernels(blk.qkv) if blk.qkv is not None else None
            if qkv is None:
                ks = [_kernels(m) for m in (blk.attn_q, blk.attn_k, blk.attn_v)]
                qkv = None if None in ks else [k[0] for k in ks]
            mlp = blk.mlp
            gu = _kernels(mlp.gate_up) if mlp.gate_up is not None else None
            if gu is None:
                ks = [_kernels(m) for m in (mlp.ffn_gate, mlp.ffn_up)]
                gu = None if None in ks else [k[0] for k in ks]
            o, down = _kernels(blk.attn_output), _kernels(mlp.ffn_down)
            linears = (blk.attn_q, blk.attn_k, blk.attn_v, blk.attn_output, mlp.ffn_gate,
                       mlp.ffn_up, mlp.ffn_down, blk.qkv, mlp.gate_up)  # fmt: skip
            biased = any(getattr(m, "bias", None) is not None for m in linears)
            if qkv is None or gu is None or o is None or down is None or biased:
                return None
            norms = (blk.attn_norm.weight.float().contiguous(), blk.ffn_norm.weight.float())
            parts.append((qkv, o[0], gu, down[0], norms[0], norms[1].contiguous()))
        rot = getattr(model, "rotary", None)
        if rot is None:
            return None
        lib = decode_step.load()
        if lib is None:
            return None
        shape = decode_step.Shape(args.dim, args.n_heads, args.n_kv_heads, args.head_dim,
                                  args.hidden_dim, rot.cfg.dims, rot.cfg.neox, args.norm_eps,
                                  blocks[0].mlp.act)  # fmt: skip
        return cls(model, lib, shape, parts)

    def _for_cache(self, kv) -> decode_step.DecodeStep | None:
        if self._step is not None and self._step[0] is kv:
            return self._step[1]
        if kv.k_scales is not None or kv.k[0].dtype not in (torch.float32, torch.float16):
            return None
        specs = [
            decode_step.LayerSpec(qkv, o, gu, down, an, fn, kv.k[i], kv.v[i])
            for i, (qkv, o, gu, down, an, fn) in enumerate(self.parts)
        ]
        try:
            step = decode_step.DecodeStep(self.lib, self.shape, specs, kv.block_size)
        except ValueError:
            return None
        self._step = (kv, step)
        return step

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, batch: BatchMeta, kv):
        """The stream after the last layer [T, dim] (before the final norm), or None where the
        step does not qualify (then the caller runs the torch layers)."""
        t = ids.shape[0]
        if ids.is_cuda or not 0 < t <= MAX_ROWS or batch.context is not None:
            return None
        if batch.embeds is not None or batch.query_start != tuple(range(t + 1)):
            return None
        lora = getattr(self.model, "lora", None)  # engine.lora: this step's rows on adapters
        if lora is not None and lora.active:
            return None
        step = self._for_cache(kv)
        if step is None:
            return None
        x = self.model.token_embd(ids).float().contiguous()
        cos, sin = (c.contiguous() for c in self.model.rotary.cos_sin(positions))
        width = max(len(tb) for tb in batch.block_tables)
        tables = torch.tensor([(*tb, *(0,) * (width - len(tb))) for tb in batch.block_tables])
        seq_lens = torch.tensor(batch.seq_lens, dtype=torch.int64)
        slots = batch.slot_mapping.to(torch.int64).contiguous()
        return step(x, cos, sin, slots, seq_lens, tables.reshape(t, width))
