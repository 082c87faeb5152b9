"""The `lfm2` GGUF architecture: Liquid AI's LFM2 (350M, 700M, 1.2B, 2.6B) and LFM2.5 dense models.

Follows llama.cpp's lfm2 graph. Every block is pre-norm: `attn_norm` (transformers' operator
norm), then either a gated short convolution or attention, residual; `ffn_norm`, SwiGLU,
residual. The layers whose `attention.head_count_kv` is 0 are convolutions: `shortconv.in_proj`
makes B, C and x; B * x goes through a depthwise causal conv of `shortconv.l_cache` taps (no
bias, no activation) over the sequence's last inputs, kept per sequence as recurrent state
(`engine.runtime.recurrent_state`); C gates its output before `shortconv.out_proj`. The others
attend with per-head q/k RMSNorms and NEOX rope. The final norm is stored as `token_embd_norm`;
the output head is tied when `output.weight` is absent.
"""

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from localllm.engine.layers.linear import FusedLinear, QuantLinear
from localllm.engine.layers.recurrent import gated_short_conv, gated_short_conv_q
from localllm.engine.layers.rope import RopeConfig, Rotary
from localllm.engine.layers.shared import DenseParam, GatedMLP, RMSNorm, rope_attention_q
from localllm.engine.models.common import arch_key, attention_layers, rope_scale
from localllm.engine.models.decoder import Decoder
from localllm.engine.models.hparams import HyperparameterError
from localllm.kernels.fused import QUANT_MAX_ROWS
from localllm.kernels.fused.heads import HeadNorms

# llama's layout for the blocks: each residual add in the next norm's kernel (an MoE block's
# weighted expert rows summed there too), the norms' int8 rows handed to the linears that read
# them, q|k|v as one linear, the attention's output rows quantized by its kernel: on a CUDA
# decode step ~3 launches fewer a layer. On since an H100 timed it (2026-12-07 21:54 UTC,
# tests/perf/results/hybrid.md: LFM2-8B-A1B tg128 913.4 t/s against 757.6 off, llama.cpp 620.5;
# off: a norm, the linears' own quantization and a residual add each a kernel).
FUSED_RESIDUAL = True
# The short conv's decode step writes out_proj's int8 rows itself (what `quantize_x8` makes of
# its float32 output: one launch fewer a conv layer). Tested under the interpreter; not yet
# timed on a GPU, so off.
CONV_QUANT = False


@dataclass(frozen=True)
class ModelArgs:
    arch: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int  # of the attention layers
    head_dim: int
    hidden_dim: int
    norm_eps: float
    rope_base: float
    rope_linear_scale: float
    context_length: int
    conv_taps: int  # shortconv.l_cache
    attn_layers: tuple[int, ...]  # the rest are short convolutions
    sliding_window: int  # 0: none; llama.cpp's SWA variant (refused, see `check`)

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], vocab_size: int) -> "ModelArgs":
        k = arch_key(meta)
        n_layers, n_heads, dim = k("block_count"), k("attention.head_count"), k("embedding_length")
        attn, n_kv = attention_layers(k, n_layers)
        return cls(
            arch=meta["general.architecture"],
            vocab_size=vocab_size,
            dim=dim,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=n_kv or n_heads,
            head_dim=dim // n_heads,
            hidden_dim=k("feed_forward_length"),
            norm_eps=k("attention.layer_norm_rms_epsilon", 1e-5),
            rope_base=k("rope.freq_base", 1e6),
            rope_linear_scale=rope_scale(meta),
            context_length=k("context_length", 128000),
            conv_taps=k("shortconv.l_cache"),
            attn_layers=attn,
            sliding_window=k("attention.sliding_window", 0),
        )

    @property
    def kv_layers(self) -> int:
        """Layers with KV (the residency plan's estimate): the attention ones."""
        return len(self.attn_layers)

    def check(self) -> None:
        """lfm2's own relations (the shared ones: `hparams.check_args`)."""
        if self.sliding_window:  # never run a sliding-window file with full attention
            raise HyperparameterError(
                f"attention.sliding_window is {self.sliding_window}: LFM2's sliding-window "
                "attention is not implemented"
            )
        if self.dim % self.n_heads:
            raise HyperparameterError(
                f"embedding_length {self.dim} is not a multiple of head_count {self.n_heads}"
            )


class ShortConv(nn.Module):
    """in_proj -> (B, C, x); C * conv(B * x) -> out_proj, the conv over the carried inputs."""

    def __init__(self, args: ModelArgs, layer: int, precise: bool):
        super().__init__()
        self.layer = layer
        self.in_proj = QuantLinear(args.dim, 3 * args.dim, precise)
        self.conv = DenseParam(args.dim, args.conv_taps)  # [channels, taps]
        self.out_proj = QuantLinear(args.dim, args.dim, precise)

    def forward(self, h, batch, kv, hq=None) -> torch.Tensor:
        """`hq`: h's int8 rows from the norm that made it (FUSED_RESIDUAL), or None."""
        bcx = self.in_proj(h, hq)
        if CONV_QUANT:  # out_proj's int8 rows from the conv step's launch
            quant = self.out_proj.takes_quantized and h.shape[0] <= QUANT_MAX_ROWS
            y, yq = gated_short_conv_q(bcx, self.conv.value, batch, kv, self.layer, h.dtype, quant)
            return self.out_proj(y, yq)
        return self.out_proj(gated_short_conv(bcx, self.conv.value, batch, kv, self.layer, h.dtype))


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, kv_layer: int | None, precise: bool):
        super().__init__()
        self.args, self.kv_layer = args, kv_layer
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        if kv_layer is None:
            self.shortconv = ShortConv(args, layer, precise)
        else:
            hd, nq, nkv = args.head_dim, args.n_heads, args.n_kv_heads
            self.attn_q = QuantLinear(args.dim, nq * hd, precise)
            self.attn_k = QuantLinear(args.dim, nkv * hd, precise)
            self.attn_v = QuantLinear(args.dim, nkv * hd, precise)
            self.attn_output = QuantLinear(nq * hd, args.dim, precise)
            self.attn_q_norm = RMSNorm(hd, args.norm_eps)
            self.attn_k_norm = RMSNorm(hd, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = GatedMLP(args.dim, args.hidden_dim, "silu", precise)
        self.qkv: FusedLinear | None = None  # (FUSED_RESIDUAL, attention layers)

    def fuse(self) -> None:
        """After loading: the MLP's gate | up; with FUSED_RESIDUAL q|k|v too and an MoE's
        output left for the next norm to add."""
        self.mlp.fuse()
        if not FUSED_RESIDUAL:
            return
        if self.kv_layer is not None:
            parts = [self.attn_q, self.attn_k, self.attn_v]
            if FusedLinear.fusable(parts, mixed=True):
                self.qkv = FusedLinear(parts)
        if hasattr(self.mlp, "sum_in_norm"):  # routed experts: their rows summed in the norm
            self.mlp.sum_in_norm = True

    def attend(self, h, cos_sin, rotary, batch, kv, hq=None) -> torch.Tensor:
        a = self.args
        if self.qkv is not None:  # q, k, v side by side in one output: views, no copies
            q, k, v = self.qkv(h, hq)
        else:
            q, k, v = self.attn_q(h, hq), self.attn_k(h, hq), self.attn_v(h, hq)
        lay = rotary.layout(a.n_heads, a.n_kv_heads, a.head_dim)
        norms = HeadNorms(self.attn_q_norm.weight, self.attn_k_norm.weight, a.norm_eps)
        quant = FUSED_RESIDUAL and self.attn_output.takes_quantized
        o, oq = rope_attention_q(q, k, v, lay, cos_sin, rotary, batch, kv, self.kv_layer,
                                 a.head_dim**-0.5, norms, quant=quant,
                                 feeds=self.attn_output if FUSED_RESIDUAL else None)  # fmt: skip
        return self.attn_output(o.reshape(-1, a.n_heads * a.head_dim), oq)

    def forward(self, x, cos_sin, rotary, batch, kv) -> torch.Tensor:
        h = self.attn_norm(x)
        if self.kv_layer is None:
            x = x + self.shortconv(h, batch, kv)
        else:
            x = x + self.attend(h, cos_sin, rotary, batch, kv)
        return x + self.mlp(self.ffn_norm(x))

    def forward_fused(self, x, r, cos_sin, rotary, batch, kv):
        """FUSED_RESIDUAL's form: the stream is x + r (r: the previous block's output not yet
        added, or None); returns the new (x, r), this block's MLP output left for the next
        norm."""
        first = self.shortconv.in_proj if self.kv_layer is None else self.qkv
        if r is None:
            h, hq = self.attn_norm.forward_q(x, feeds=first)
        else:
            x, h, hq = self.attn_norm.residual_q(x, r, feeds=first)
        if self.kv_layer is None:
            mix = self.shortconv(h, batch, kv, hq)
        else:
            mix = self.attend(h, cos_sin, rotary, batch, kv, hq)
        x, h, hq = self.ffn_norm.residual_q(x, mix, feeds=getattr(self.mlp, "first", None))
        return x, self.mlp(h, hq)


class Model(Decoder):
    tensor_aliases = {**Decoder.tensor_aliases, "token_embd_norm": "output_norm"}  # noqa: RUF012
    block_cls = Block  # lfm2moe reuses this model with its own block
    # its short convs (engine.layers.recurrent) read a prompt graph's layout from the device
    state_in_prompt_graphs = True

    def __init__(self, args: ModelArgs, precise: bool = False):
        kv_index = {layer: j for j, layer in enumerate(args.attn_layers)}
        blocks = [self.block_cls(args, i, kv_index.get(i), precise) for i in range(args.n_layers)]
        super().__init__(args, blocks, precise)

    def kv_shape(self) -> tuple[int, int, int]:
        """Only the attention layers keep KV (numbered in order); at least one layer's worth."""
        a = self.args
        return max(1, len(a.attn_layers)), a.n_kv_heads, a.head_dim

    def state_shapes(self) -> dict[int, dict[str, tuple[int, ...]]]:
        """Each convolution keeps its last l_cache - 1 inputs (`engine.runtime.recurrent_state`)."""
        a = self.args
        conv = {"conv": (a.conv_taps - 1, a.dim)}
        return {i: conv for i in range(a.n_layers) if i not in a.attn_layers}

    def forward(self, ids, positions, batch, kv) -> torch.Tensor:
        """Hidden states [T, dim] after the final norm."""
        x = self.native_decode(ids, positions, batch, kv)  # CPU decode steps: one native call
        if x is not None:
            return self.output_norm(x)
        x = batch.splice(self.token_embd(ids))
        cos_sin = self.rotary.cos_sin(positions)
        if not FUSED_RESIDUAL:
            for blk in self.blk:
                x = blk(x, cos_sin, self.rotary, batch, kv)
            return self.output_norm(x)
        r = None
        for blk in self.blk:
            x, r = blk.forward_fused(x, r, cos_sin, self.rotary, batch, kv)
        return self.output_norm.residual(x, r)[1]

    def finish_load(self, extra: dict[str, torch.Tensor]) -> None:
        """Called by the loader after every tensor is in place."""
        self.tie_output()
        a = self.args
        cfg = RopeConfig(a.head_dim, a.rope_base, neox=True, linear_scale=a.rope_linear_scale)
        self.rotary = Rotary(cfg)
        for blk in self.blk:
            blk.fuse()
