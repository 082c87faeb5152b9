"""The `granitehybrid` GGUF architecture: IBM Granite 4.0-H (Micro, Tiny, Small): Mamba-2 layers
with a few attention layers, MoE with a shared expert (dense for Micro).

Follows llama.cpp's granite-hybrid graph. Embeddings are scaled by `embedding_scale`; every block
is pre-norm (`attn_norm`, then a Mamba-2 mixer or attention, its output times `residual_scale`
added; `ffn_norm`, then routed experts plus the shared MLP, or the dense MLP, times
`residual_scale` added); logits are divided by `logit_scale`. A layer whose
`attention.head_count_kv` is 0 is Mamba-2: `ssm_in` makes the gate z, xBC and dt; xBC goes
through a depthwise causal conv (`ssm_conv1d`, bias, SiLU) over the sequence's last inputs, then
splits into x (heads of `ssm.inner_size / ssm.time_step_rank`), B and C (`ssm.group_count` groups
of `ssm.state_size`); the selective scan runs from the sequence's SSM state with dt =
softplus(dt + `ssm_dt.bias`) and A = `ssm_a` (-exp(A_log)), adds the D skip (`ssm_d`), gates
by SiLU(z) and normalises per group (`ssm_norm`) before `ssm_out`. Conv and SSM states are kept
per sequence (`engine.runtime.recurrent_state`). Attention layers have no rope (Granite 4.0-H
writes `rope.scaling.finetuned` false) and scale scores by `attention.scale`. Routing: softmax
over the top-k router logits (llama.cpp: softmax, weights renormalised).
"""

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from localllm.engine.layers.linear import FusedLinear, QuantLinear, dense
from localllm.engine.layers.recurrent import mamba2_conv_dt, mamba2_decode, short_conv, ssd
from localllm.engine.layers.shared import DenseParam, GatedMLP, RMSNorm, attention
from localllm.engine.models.common import arch_key, attention_layers
from localllm.engine.models.decoder import Decoder
from localllm.engine.models.hparams import HyperparameterError
from localllm.engine.moe.block import MoEFeedForward, Routing
from localllm.engine.moe.expert_tensor import EXPERT_TENSORS
from localllm.kernels.fused import QUANT_MAX_ROWS
from localllm.kernels.recurrent.gated_norm import skip_gate_norm, skip_gate_norm_q
from localllm.kernels.recurrent.ssd import Mamba2Mixer

# llama's block layout for Granite 4.0-H (as `lfm2.FUSED_RESIDUAL`): each residual add, times
# residual_scale, runs in the next norm's kernel, whose int8 rows go to the linears that read
# them (ssm_in, q|k|v fused, the shared and routed experts: one activation quantization a norm
# instead of one a linear); on CUDA five launches fewer a Mamba-2 layer. The torch layers equal
# the plain blocks bit for bit (tests/engine/test_granite_fused_residual.py); not yet timed on a
# GPU, so off.
FUSED_RESIDUAL = False
# The Mamba-2 mixer's decode step on CUDA in fewer launches: the conv step and softplus(dt + bias)
# in one, the gated norm writing ssm_out's int8 rows itself (three launches fewer a layer). Tested
# under the interpreter against transformers' logits; not yet timed on a GPU, so off.
FUSED_MIXER = False


@dataclass(frozen=True)
class ModelArgs:
    arch: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int  # of the attention layers
    head_dim: int
    hidden_dim: int  # the dense MLP's, or each expert's
    norm_eps: float
    context_length: int
    attn_layers: tuple[int, ...]  # the rest are Mamba-2
    d_conv: int
    d_inner: int
    d_state: int
    n_ssm_heads: int
    n_groups: int
    n_expert: int
    n_expert_used: int
    shared_hidden: int
    expert_scale: float  # the routing weights' factor (llama.cpp: 0 is none)
    attn_scale: float
    embedding_scale: float
    residual_scale: float
    logit_scale: float
    rope: bool
    rope_base: float  # read and checked as llama.cpp does, though 4.0-H attends without rope

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], vocab_size: int) -> "ModelArgs":
        k = arch_key(meta)
        n_layers, n_heads, dim = k("block_count"), k("attention.head_count"), k("embedding_length")
        attn, n_kv = attention_layers(k, n_layers)
        head_dim = dim // n_heads
        return cls(
            arch=meta["general.architecture"],
            vocab_size=vocab_size,
            dim=dim,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=n_kv or n_heads,
            head_dim=head_dim,
            hidden_dim=k("feed_forward_length"),
            norm_eps=k("attention.layer_norm_rms_epsilon", 1e-5),
            context_length=k("context_length", 1 << 20),
            attn_layers=attn,
            d_conv=k("ssm.conv_kernel"),
            d_inner=k("ssm.inner_size"),
            d_state=k("ssm.state_size"),
            n_ssm_heads=k("ssm.time_step_rank"),
            n_groups=k("ssm.group_count"),
            n_expert=k("expert_count", 0),
            n_expert_used=k("expert_used_count", 0),
            shared_hidden=k("expert_shared_feed_forward_length", 0),
            expert_scale=k("expert_weights_scale", 0.0) or 1.0,
            # llama.cpp: a scale of 0 (or none) is 1/sqrt(head), 1 and 1 for the others
            attn_scale=k("attention.scale", 0.0) or head_dim**-0.5,
            embedding_scale=k("embedding_scale", 1.0),
            residual_scale=k("residual_scale", 1.0),
            logit_scale=k("logit_scale", 1.0),
            rope=k("rope.scaling.finetuned", True),
            rope_base=k("rope.freq_base", 10000.0),
        )

    @property
    def kv_layers(self) -> int:
        """Layers with KV (the residency plan's estimate): the attention ones."""
        return len(self.attn_layers)

    @property
    def head_size(self) -> int:
        """One SSM head's width (P)."""
        return self.d_inner // self.n_ssm_heads

    def check(self) -> None:
        """granitehybrid's own relations (the shared ones: `hparams.check_args`)."""
        if self.rope and self.attn_layers:
            raise HyperparameterError(
                "rope.scaling.finetuned is true: attention with rope in a granitehybrid file "
                "(Bamba) is not supported; Granite 4.0-H attends without it"
            )
        if self.d_conv < 2:
            raise HyperparameterError(f"ssm.conv_kernel is {self.d_conv}, expected at least 2")
        h, g = self.n_ssm_heads, self.n_groups
        if self.d_inner % h or h % g:
            raise HyperparameterError(
                f"ssm.inner_size {self.d_inner}, ssm.time_step_rank {h} and ssm.group_count {g}: "
                "the heads must divide the inner size and the groups the heads"
            )
        if self.dim % self.n_heads:
            raise HyperparameterError(
                f"embedding_length {self.dim} is not a multiple of head_count {self.n_heads}"
            )


class Conv1d(nn.Module):
    """`ssm_conv1d`: the depthwise conv's weight [channels, taps] and optional bias, float32."""

    def __init__(self, channels: int, taps: int):
        super().__init__()
        self.shape = (channels, taps)
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None

    def load_tensor(self, suffix: str, w) -> None:
        want = self.shape if suffix == "weight" else self.shape[:1]
        if suffix not in ("weight", "bias") or tuple(w.shape) != want:
            raise ValueError(f"expected {suffix} of shape {want}, got {tuple(w.shape)}")
        setattr(self, suffix, dense(w))

    @property
    def loaded(self) -> bool:
        return self.weight is not None


class Mamba2(nn.Module):
    """The Mamba-2 mixer of one layer; its modules are the block's `ssm_*` tensors."""

    def __init__(self, args: ModelArgs, layer: int, precise: bool):
        super().__init__()
        a = args
        self.args, self.layer = a, layer
        self.conv_dim = a.d_inner + 2 * a.n_groups * a.d_state
        self.ssm_in = QuantLinear(a.dim, a.d_inner + self.conv_dim + a.n_ssm_heads, precise)
        self.ssm_conv1d = Conv1d(self.conv_dim, a.d_conv)
        self.ssm_dt = DenseParam(a.n_ssm_heads)  # its `bias`
        self.ssm_norm = DenseParam(a.n_groups, a.d_inner // a.n_groups)
        self.ssm_out = QuantLinear(a.d_inner, a.dim, precise)

    def forward(self, h, A, D, batch, kv, hq=None) -> torch.Tensor:
        """`hq`: h's int8 rows from the norm that made it (FUSED_RESIDUAL), or None."""
        a = self.args
        t, hs, p, g, n = h.shape[0], a.n_ssm_heads, a.head_size, a.n_groups, a.d_state
        zxd = self.ssm_in(h, hq).float()
        conv = self.ssm_conv1d
        # a CPU decode step: conv, scan, gate and norm in one native call
        mixer = Mamba2Mixer(conv.weight, conv.bias, self.ssm_dt.value, A, D,
                            self.ssm_norm.value, a.norm_eps, hs, g)  # fmt: skip
        y = mamba2_decode(zxd, mixer, batch, kv, self.layer)
        if y is not None:
            return self.ssm_out(y.to(h.dtype))
        z, xbc, dt = zxd.split([a.d_inner, self.conv_dim, hs], dim=-1)
        fused = None
        if FUSED_MIXER:  # (decode on CUDA: one launch for both)
            fused = mamba2_conv_dt(xbc, conv.weight, conv.bias, dt, self.ssm_dt.value, batch,
                                   kv, self.layer)  # fmt: skip
        if fused is not None:
            xbc, dt = fused
        else:
            xbc = short_conv(xbc, conv.weight, batch, kv, self.layer, "conv", conv.bias, silu=True)
            dt = F.softplus(dt + self.ssm_dt.value)
        x, b, c = xbc.split([a.d_inner, g * n, g * n], dim=-1)
        x = x.reshape(t, hs, p)
        y = ssd(x, dt, A, b.reshape(t, g, n), c.reshape(t, g, n), batch, kv, self.layer, "ssm")
        # D skip, SiLU(z) gate, RMSNorm per group of d_inner / n_groups channels
        w = self.ssm_norm.value
        if FUSED_MIXER:  # ssm_out's int8 rows from the same launch
            quant = self.ssm_out.takes_quantized and t <= QUANT_MAX_ROWS
            o, oq = skip_gate_norm_q(y, x, D, z, w, a.norm_eps, h.dtype, quant)
            return self.ssm_out(o, oq)
        return self.ssm_out(skip_gate_norm(y, x, D, z, w, a.norm_eps, h.dtype))


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, kv_layer: int | None, precise: bool):
        super().__init__()
        a = args
        self.args, self.kv_layer = a, kv_layer
        self.attn_norm = RMSNorm(a.dim, a.norm_eps)
        self.ssm_a: torch.Tensor | None = None  # the file's bare `ssm_a` and `ssm_d` [H]
        self.ssm_d: torch.Tensor | None = None
        if kv_layer is None:
            self.mamba = Mamba2(a, layer, precise)
        else:
            hd = a.head_dim
            self.attn_q = QuantLinear(a.dim, a.n_heads * hd, precise)
            self.attn_k = QuantLinear(a.dim, a.n_kv_heads * hd, precise)
            self.attn_v = QuantLinear(a.dim, a.n_kv_heads * hd, precise)
            self.attn_output = QuantLinear(a.n_heads * hd, a.dim, precise)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps)
        if a.n_expert:
            self.mlp = MoEFeedForward(
                layer, a.dim, a.hidden_dim, a.n_expert, a.n_expert_used, True,
                precise=precise, shared_hidden=a.shared_hidden,
                routing=Routing(scale=a.expert_scale) if a.expert_scale != 1.0 else None,
            )  # fmt: skip
        else:
            self.mlp = GatedMLP(a.dim, a.hidden_dim, "silu", precise)
        self.qkv: FusedLinear | None = None  # (FUSED_RESIDUAL, attention layers)

    def fuse(self) -> None:
        """After loading: the MLP's fused projections; with FUSED_RESIDUAL q|k|v too and the
        experts' decode rows left for the next norm to sum (`moe.block.SHARED_IN_NORM`: with the
        shared expert's)."""
        self.mlp.fuse()
        if FUSED_RESIDUAL and hasattr(self.mlp, "sum_in_norm"):
            self.mlp.sum_in_norm = True
        if FUSED_RESIDUAL and self.kv_layer is not None:
            parts = [self.attn_q, self.attn_k, self.attn_v]
            if FusedLinear.fusable(parts, mixed=True):
                self.qkv = FusedLinear(parts)

    # `blk.N.ssm_a` and `blk.N.ssm_d` have no suffix: the loader hands them to the block itself
    def load_tensor(self, suffix: str, w) -> None:
        h = self.args.n_ssm_heads
        if suffix not in ("ssm_a", "ssm_d") or self.kv_layer is not None or math.prod(w.shape) != h:
            raise ValueError(f"unexpected {suffix} of shape {tuple(w.shape)} (expected ({h}, 1))")
        setattr(self, suffix, dense(w).reshape(h))

    @property
    def loaded(self) -> bool:
        return self.kv_layer is not None or (self.ssm_a is not None and self.ssm_d is not None)

    def attend(self, h, batch, kv, hq=None) -> torch.Tensor:
        a = self.args
        hd = a.head_dim
        if self.qkv is not None:  # q, k, v side by side in one output: views, no copies
            q, k, v = self.qkv(h, hq)
        else:
            q, k, v = self.attn_q(h, hq), self.attn_k(h, hq), self.attn_v(h, hq)
        q = q.reshape(-1, a.n_heads, hd)
        k = k.reshape(-1, a.n_kv_heads, hd)
        v = v.reshape(-1, a.n_kv_heads, hd)
        o = attention(q, k, v, None, batch, kv, self.kv_layer, a.attn_scale)
        return self.attn_output(o.reshape(-1, a.n_heads * hd))

    def forward(self, x, batch, kv) -> torch.Tensor:
        s = self.args.residual_scale
        h = self.attn_norm(x)
        if self.kv_layer is None:
            out = self.mamba(h, self.ssm_a, self.ssm_d, batch, kv)
        else:
            out = self.attend(h, batch, kv)
        x = x.add(out, alpha=s)  # x + out * s in one launch
        return x.add(self.mlp(self.ffn_norm(x)), alpha=s)

    def forward_fused(self, x, r, batch, kv):
        """FUSED_RESIDUAL's form: the stream is x + s * r (r: the previous block's output not yet
        added, or None); returns the new (x, r), this block's MLP output left for the next
        norm."""
        s = self.args.residual_scale
        if self.kv_layer is None:
            first = self.mamba.ssm_in
        else:
            first = self.qkv if self.qkv is not None else self.attn_q
        if r is None:
            h, hq = self.attn_norm.forward_q(x, feeds=first)
        else:
            x, h, hq = self.attn_norm.residual_q(x, r, feeds=first, scale=s)
        if self.kv_layer is None:
            out = self.mamba(h, self.ssm_a, self.ssm_d, batch, kv, hq)
        else:
            out = self.attend(h, batch, kv, hq)
        x, h, hq = self.ffn_norm.residual_q(x, out, feeds=getattr(self.mlp, "first", None),
                                             scale=s)  # fmt: skip
        return x, self.mlp(h, hq)


class Model(Decoder):
    tensor_aliases = {  # noqa: RUF012 (a class constant the loader reads)
        **Decoder.tensor_aliases,
        **{n: f"mlp.{n}" for n in ("ffn_gate_inp", *EXPERT_TENSORS)},
        **{f"ffn_{p}_shexp": f"mlp.shexp.ffn_{p}" for p in ("gate", "up", "down")},
        **{f"ssm_{n}": f"mamba.ssm_{n}" for n in ("in", "conv1d", "dt", "norm", "out")},
    }
    takes_embeds = False  # no multimodal granitehybrid file yet
    # its recurrent layers (engine.layers.recurrent) read a prompt graph's layout from the device
    state_in_prompt_graphs = True

    def __init__(self, args: ModelArgs, precise: bool = False):
        kv_index = {layer: j for j, layer in enumerate(args.attn_layers)}
        blocks = [Block(args, i, kv_index.get(i), precise) for i in range(args.n_layers)]
        super().__init__(args, blocks, precise)
        self.embed_scale = args.embedding_scale
        outputs = (f"blk.{i}.attn_output.bias" for i in args.attn_layers)
        self.optional_tensors = (*Decoder.optional_tensors, *outputs)

    def kv_shape(self) -> tuple[int, int, int]:
        """Only the attention layers keep KV (numbered in order); at least one layer's worth."""
        a = self.args
        return max(1, len(a.attn_layers)), a.n_kv_heads, a.head_dim

    def state_shapes(self) -> dict[int, dict[str, tuple[int, ...]]]:
        """Each Mamba-2 layer keeps its conv's last inputs and its SSM state."""
        a = self.args
        conv_dim = a.d_inner + 2 * a.n_groups * a.d_state
        shapes = {"conv": (a.d_conv - 1, conv_dim), "ssm": (a.n_ssm_heads, a.head_size, a.d_state)}
        return {i: shapes for i in range(a.n_layers) if i not in a.attn_layers}

    def forward(self, ids, positions, batch, kv) -> torch.Tensor:
        """Hidden states [T, dim] after the final norm."""
        x = self.native_decode(ids, positions, batch, kv)  # CPU decode steps: one native call
        if x is not None:
            return self.output_norm(x)
        x = batch.splice(self.token_embd(ids)) * self.embed_scale
        if not FUSED_RESIDUAL:
            for blk in self.blk:
                x = blk(x, batch, kv)
            return self.output_norm(x)
        r = None
        for blk in self.blk:
            x, r = blk.forward_fused(x, r, batch, kv)
        return self.output_norm.residual(x, r, scale=self.args.residual_scale)[1]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.output(hidden) / self.args.logit_scale

    def finish_load(self, extra: dict[str, torch.Tensor]) -> None:
        """Called by the loader after every tensor is in place."""
        self.tie_output()
        for blk in self.blk:
            blk.fuse()
