"""The `qwen3next` GGUF architecture: Qwen3-Next (80B-A3B Instruct / Thinking), a hybrid of gated
DeltaNet linear attention and gated full attention over a sparse MoE.

Follows llama.cpp's qwen3next graph. Layer i is a recurrent one unless (i + 1) is a multiple of
`full_attention_interval` (4): then it is full attention. Both kinds are pre-norm (`attn_norm`)
with a residual, then `post_attention_norm` before the FFN (the converter folds Qwen3-Next's
1 + w norms into plain RMSNorm weights).
- Gated DeltaNet (`attn_qkv`, `attn_gate`, `ssm_*`; older files: one `ssm_in` with q/k/v/z
  grouped per key head): q/k/v from one projection through a causal
  depthwise conv of `ssm.conv_kernel` taps and SiLU; q and k L2-normalised per head (the
  `ssm.group_count` key heads each serve `time_step_rank / group_count` value heads), q scaled by
  1/sqrt(head); decay g = ssm_a * softplus(a + ssm_dt.bias) (ssm_a is -exp(A_log)), write
  strength beta = sigmoid(b), from `ssm_ba` (b then a, per key head); the gated delta rule
  (`kernels.recurrent.delta_rule`); RMSNorm of each head's output (`ssm_norm`) times SiLU of the
  gate z, then `ssm_out`. Each sequence keeps its conv inputs and delta state in its state slot
  (`engine.runtime.recurrent_state`).
- Full attention: `attn_q` gives each head's query and an output gate side by side; per-head q/k
  RMSNorm, NEOX rope over the first `rope.dimension_count` dims (a quarter), softmax attention
  over the paged cache, output times sigmoid(gate). Only these layers have KV: the cache holds
  one layer per full-attention layer.
- FFN: softmax top-k routed experts (renormalised) through the shared MoE block (so `--cpu-moe`
  and `--experts disk` apply), plus a shared expert scaled by sigmoid(`ffn_gate_inp_shexp` . x).

The multi-token-prediction block a converter appends (`nextn_predict_layers`) is never run nor
loaded (`unused_blocks`), as llama.cpp's main graph does.
"""

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from localllm.engine.layers.linear import FusedLinear, QuantLinear, dense
from localllm.engine.layers.rope import RopeConfig, Rotary
from localllm.engine.layers.shared import DenseParam, GatedMLP, RMSNorm, rope_attention_q
from localllm.engine.models import qwen2
from localllm.engine.models.common import arch_key
from localllm.engine.models.decoder import Decoder
from localllm.engine.models.hparams import HyperparameterError
from localllm.engine.moe.block import MoEFeedForward
from localllm.engine.moe.expert_tensor import EXPERT_TENSORS
from localllm.engine.runtime.recurrent_state import states_of
from localllm.kernels.fused import QUANT_MAX_ROWS
from localllm.kernels.fused.heads import HeadNorms
from localllm.kernels.fused.ops import gated_add, gated_add_dot
from localllm.kernels.recurrent.causal_conv import causal_conv_prefill
from localllm.kernels.recurrent.decode import (
    conv_decode,
    gated_delta_decode,
    gated_delta_raw,
    norm_gate,
    norm_gate_q,
)
from localllm.kernels.recurrent.delta_rule import delta_rule_chunked, l2_normalize

# Fewer launches on CUDA: the DeltaNet layers' decode steps with attn_qkv, attn_gate and ssm_ba
# as one linear (one quantization of h, views of one output), g and beta made inside the delta
# rule's launch from ssm_ba's row, the gated norm one launch (~10 launches fewer a layer); every
# block's FFN with the norm's int8 rows for the routed and the shared expert, its end (residual,
# experts, the shared expert's sigmoid gate) one launch (~5 fewer). On since an H100 timed it
# (2026-12-07 21:54 UTC, tests/perf/results/hybrid.md: Qwen3-Next 12 layers tg128 779.0 t/s
# against 645.9 off, llama.cpp 656.7; off: the torch ops between the kernels).
FUSED_DECODE = True
# With FUSED_DECODE, fewer still: the residual add in the FFN's norm, the input norms' int8 rows
# to the linears (the DeltaNet's one input linear, q, k and v), the gated norm writing ssm_out's
# int8 rows, the shared expert gate's logit summed in the block end's kernel (about 4 launches
# fewer a DeltaNet layer). Tested on the CPU and under the interpreter; not yet timed on a GPU.
FUSED_NORMS = False


@dataclass(frozen=True)
class ModelArgs(qwen2.ModelArgs):
    rope_dims: int
    n_expert: int
    n_expert_used: int
    expert_hidden_dim: int
    shexp_hidden_dim: int
    n_nextn: int  # NextN layers after the `n_layers` that run
    full_attn_interval: int
    conv_kernel: int  # ssm.conv_kernel: taps of the short conv
    head_k_dim: int  # ssm.state_size
    n_k_heads: int  # ssm.group_count
    n_v_heads: int  # ssm.time_step_rank
    value_dim: int  # ssm.inner_size: n_v_heads * head_v_dim

    @property
    def head_v_dim(self) -> int:
        return self.value_dim // self.n_v_heads

    @property
    def conv_dim(self) -> int:
        return 2 * self.n_k_heads * self.head_k_dim + self.value_dim

    @property
    def unused_blocks(self) -> range:
        """The NextN layers' block numbers: never run, never loaded."""
        return range(self.n_layers, self.n_layers + self.n_nextn)

    @property
    def kv_layers(self) -> int:
        """Layers with a KV cache: the full-attention ones (the residency plan's estimate)."""
        return sum(not self.recurrent(i) for i in range(self.n_layers))

    def recurrent(self, layer: int) -> bool:
        return (layer + 1) % self.full_attn_interval != 0

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], vocab_size: int) -> "ModelArgs":
        k = arch_key(meta)
        base = qwen2.ModelArgs.from_gguf(meta, vocab_size)
        fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
        n_nextn = k("nextn_predict_layers", 0)
        fields["n_layers"] = base.n_layers - n_nextn
        expert_ff = k("expert_feed_forward_length")
        return cls(
            **fields,
            rope_dims=k("rope.dimension_count", base.head_dim),
            n_expert=k("expert_count"),
            n_expert_used=k("expert_used_count"),
            expert_hidden_dim=expert_ff,
            shexp_hidden_dim=k("expert_shared_feed_forward_length", 0),
            n_nextn=n_nextn,
            full_attn_interval=k("full_attention_interval", 4),
            conv_kernel=k("ssm.conv_kernel"),
            head_k_dim=k("ssm.state_size"),
            n_k_heads=k("ssm.group_count"),
            n_v_heads=k("ssm.time_step_rank"),
            value_dim=k("ssm.inner_size"),
        )

    def check(self) -> None:
        """Relations of qwen3next's own keys (the shared ones: `hparams.check_args`)."""
        if self.n_layers < 1:
            raise HyperparameterError(
                f"nextn_predict_layers is {self.n_nextn}: no layer of "
                f"{self.n_layers + self.n_nextn} blocks is left to run"
            )
        if self.n_expert < 1:
            raise HyperparameterError("expert_count is 0: every qwen3next block has experts")
        if self.n_v_heads % self.n_k_heads:
            raise HyperparameterError(
                f"ssm.time_step_rank (value heads) {self.n_v_heads} is not a multiple of "
                f"ssm.group_count (key heads) {self.n_k_heads}"
            )
        if self.value_dim % self.n_v_heads:
            raise HyperparameterError(
                f"ssm.inner_size {self.value_dim} does not split into {self.n_v_heads} heads"
            )
        if self.conv_kernel < 2:
            raise HyperparameterError(f"ssm.conv_kernel is {self.conv_kernel}, expected 2 or more")


class Block(nn.Module):
    """The FFN half every layer shares: `post_attention_norm`, routed experts, gated shared
    expert; subclasses add the token mixer."""

    def __init__(self, args: ModelArgs, layer: int, precise: bool):
        super().__init__()
        self.args, self.layer = args, layer
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)  # the file's post_attention_norm
        self.mlp = MoEFeedForward(
            layer, args.dim, args.expert_hidden_dim, args.n_expert, args.n_expert_used,
            norm_topk_prob=True, precise=precise,
        )  # fmt: skip
        self.shexp = GatedMLP(args.dim, args.shexp_hidden_dim, "silu", precise)
        self.ffn_gate_inp_shexp = DenseParam(1, args.dim)

    def fuse(self) -> None:
        self.shexp.fuse()

    def ffn(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """The block's FFN half on the stream x + r (r: the mixer's output)."""
        if FUSED_DECODE and FUSED_NORMS:  # the add in the norm, the gate's logit at the end
            x, h, hq = self.ffn_norm.residual_q(x, r.to(x.dtype))
            gw = self.ffn_gate_inp_shexp.value
            return gated_add_dot(x, self.mlp(h, hq), self.shexp(h, hq), h, gw).to(x.dtype)
        x = x + r.to(x.dtype)
        if FUSED_DECODE:  # h's int8 rows from the norm for both expert paths; one launch to end
            h, hq = self.ffn_norm.forward_q(x)
            g = h.float() @ self.ffn_gate_inp_shexp.value.t()
            return gated_add(x, self.mlp(h, hq), self.shexp(h, hq), g).to(x.dtype)
        h = self.ffn_norm(x)
        gate = torch.sigmoid(h.float() @ self.ffn_gate_inp_shexp.value.t())
        y = self.mlp(h).float() + gate * self.shexp(h).float()
        return x + y.to(x.dtype)


class AttentionBlock(Block):
    """Gated full attention: per-head q/k norms, partial NEOX rope, sigmoid output gate."""

    def __init__(self, args: ModelArgs, layer: int, kv_layer: int, precise: bool):
        super().__init__(args, layer, precise)
        hd, nh = args.head_dim, args.n_heads
        self.kv_layer = kv_layer  # this layer's place in the cache (full-attention layers only)
        self.attn_q = QuantLinear(args.dim, 2 * nh * hd, precise)  # per head: query, gate
        self.attn_k = QuantLinear(args.dim, args.n_kv_heads * hd, precise)
        self.attn_v = QuantLinear(args.dim, args.n_kv_heads * hd, precise)
        self.attn_output = QuantLinear(nh * hd, args.dim, precise)
        self.attn_q_norm = RMSNorm(hd, args.norm_eps)
        self.attn_k_norm = RMSNorm(hd, args.norm_eps)

    def forward(self, x, positions, cos_sin, rotary, batch, kv, layer):
        a = self.args
        t, hd = x.shape[0], a.head_dim
        h, hq = self.attn_norm.forward_q(x) if FUSED_NORMS else (self.attn_norm(x), None)
        qg = self.attn_q(h, hq).view(t, a.n_heads, 2, hd)
        q, gate = qg[:, :, 0].reshape(t, -1), qg[:, :, 1].reshape(t, -1)
        norms = HeadNorms(self.attn_q_norm.weight, self.attn_k_norm.weight, a.norm_eps)
        lay = rotary.layout(a.n_heads, a.n_kv_heads, hd)
        o, _ = rope_attention_q(q, self.attn_k(h, hq), self.attn_v(h, hq), lay, cos_sin, rotary,
                                batch, kv, self.kv_layer, hd**-0.5, norms, quant=False)  # fmt: skip
        o = o.reshape(t, -1) * torch.sigmoid(gate.to(o.dtype))
        return self.ffn(x, self.attn_output(o))


class DeltaNetBlock(Block):
    """Gated DeltaNet: short conv over q/k/v, the gated delta rule, gated RMSNorm."""

    def __init__(self, args: ModelArgs, layer: int, precise: bool):
        super().__init__(args, layer, precise)
        self.attn_qkv = QuantLinear(args.dim, args.conv_dim, precise)
        self.attn_gate = QuantLinear(args.dim, args.value_dim, precise)  # z
        # older conversions keep the checkpoint's one projection instead: per key head its q, k,
        # then the v and z of the value heads it serves (llama.cpp still reads it)
        self.ssm_in = QuantLinear(args.dim, args.conv_dim + args.value_dim, precise)
        self.ssm_ba = QuantLinear(args.dim, 2 * args.n_v_heads, precise)
        self.ssm_conv1d = DenseParam(args.conv_dim, args.conv_kernel)
        self.ssm_dt = DenseParam(args.n_v_heads)
        self.ssm_a_value: torch.Tensor | None = None  # -exp(A_log): the file's bare `ssm_a`
        self.ssm_norm = RMSNorm(args.head_v_dim, args.norm_eps)
        self.ssm_out = QuantLinear(args.value_dim, args.dim, precise)
        self.in_fused: FusedLinear | None = None  # attn_qkv | attn_gate | ssm_ba (FUSED_DECODE)

    def fuse(self) -> None:
        super().fuse()
        if FUSED_DECODE and self.ssm_dt.value.is_cuda:
            self.fuse_inputs()

    def fuse_inputs(self) -> None:
        """The three linears that read h as one (FUSED_DECODE's decode steps); the older files'
        one ssm_in keeps its own layout."""
        parts = [self.attn_qkv, self.attn_gate, self.ssm_ba]
        if not self.ssm_in.loaded and FusedLinear.fusable(parts, mixed=True):
            self.in_fused = FusedLinear(parts)

    # `blk.N.ssm_a` has no suffix: the loader hands it to the block itself
    def load_tensor(self, suffix: str, w) -> None:
        if suffix != "ssm_a" or tuple(w.shape) != (self.args.n_v_heads,):
            raise ValueError(f"expected ssm_a of shape ({self.args.n_v_heads},), got {w.shape}")
        self.ssm_a_value = dense(w)

    @property
    def loaded(self) -> bool:
        return self.ssm_a_value is not None

    def state_shape(self) -> dict[str, tuple[int, ...]]:
        a = self.args
        return {"conv": (a.conv_kernel - 1, a.conv_dim),
                "ssm": (a.n_v_heads, a.head_k_dim, a.head_v_dim)}  # fmt: skip

    def forward(self, x, positions, cos_sin, rotary, batch, kv, layer):
        a = self.args
        t = x.shape[0]
        if self.in_fused is not None and FUSED_NORMS:  # h's int8 rows for the input linear
            h, hq = self.attn_norm.forward_q(x, feeds=self.in_fused)
        else:
            h, hq = self.attn_norm(x), None
        if self.in_fused is not None:  # (FUSED_DECODE) the three input linears as one
            qkv, z, ba = self.in_fused(h, hq)
            if batch.query_start[-1] == batch.num_seqs:  # a decode step
                out = self._fused_decode(qkv, z, ba, h.dtype, batch, kv, layer)
                return self.ffn(x, out)
        else:
            (qkv, z), ba = self._project(h), self.ssm_ba(h)
        ba = ba.float().view(t, a.n_k_heads, 2, -1)  # per key head: b then a
        beta = torch.sigmoid(ba[:, :, 0].reshape(t, a.n_v_heads))
        g = self.ssm_a_value * F.softplus(ba[:, :, 1].reshape(t, a.n_v_heads) + self.ssm_dt.value)
        st, w, qs = states_of(kv), self.ssm_conv1d.value, batch.query_start
        if qs[-1] == batch.num_seqs:  # decode: one token each, straight on the state slots
            slots, fresh = st.slots(batch), st.fresh(batch)
            mixed = conv_decode(qkv, w, st.tensor(layer, "conv"), slots, fresh)
            q, k, v = self._split(mixed)
            ssm = st.tensor(layer, "ssm")
            o = gated_delta_decode(q, k, v, g, beta, ssm, slots, fresh, a.norm_eps)
        elif batch.context is not None:  # a prompt graph's padded rows
            o = self._padded_prompt(qkv, g, beta, batch, kv, layer)
        else:  # prompts (and chunks of them): each sequence from its own state
            conv, ssm = st.read(layer, "conv", batch), st.read(layer, "ssm", batch)
            outs = []
            for b in range(batch.num_seqs):
                s, e = qs[b], qs[b + 1]
                mixed = causal_conv_prefill(qkv[s:e], w, conv[b])
                q, k, v = self._heads(*self._split(mixed))
                outs.append(delta_rule_chunked(q, k, v, g[s:e], beta[s:e], ssm[b]))
            o = torch.cat(outs)
            st.write(layer, "conv", batch, conv)
            st.write(layer, "ssm", batch, ssm)
        o = self.ssm_norm(o) * F.silu(z.float().view(t, a.n_v_heads, a.head_v_dim))
        out = self.ssm_out(o.reshape(t, a.value_dim).to(h.dtype))
        return self.ffn(x, out)

    def _fused_decode(self, qkv, z, ba, dtype, batch, kv, layer: int) -> torch.Tensor:
        """FUSED_DECODE's decode step (one token a sequence, on the state slots) from the one
        input linear's parts: the conv, the delta rule with g and beta made from ssm_ba's row,
        the gated norm -> ssm_out's output."""
        st = states_of(kv)
        slots, fresh = st.slots(batch), st.fresh(batch)
        mixed = conv_decode(qkv, self.ssm_conv1d.value, st.tensor(layer, "conv"), slots, fresh)
        q, k, v = self._split(mixed)
        o = gated_delta_raw(q, k, v, ba, self.ssm_dt.value, self.ssm_a_value,
                            st.tensor(layer, "ssm"), slots, fresh, self.args.norm_eps)  # fmt: skip
        if FUSED_NORMS:  # ssm_out's int8 rows from the gated norm's launch
            quant = self.ssm_out.takes_quantized and o.shape[0] <= QUANT_MAX_ROWS
            y, yq = norm_gate_q(o, z, self.ssm_norm.weight, self.ssm_norm.eps, dtype, quant)
            return self.ssm_out(y, yq)
        return self.ssm_out(norm_gate(o, z, self.ssm_norm.weight, self.ssm_norm.eps, dtype))

    def _padded_prompt(self, qkv, g, beta, batch, kv, layer: int) -> torch.Tensor:
        """A prompt graph's P rows (`engine.layers.recurrent.prompt_graph_plans`): the chunk's n
        rows on its slot, then padding, with n known only on the device. The padding's decay and
        write strength are zeroed, so its rows leave the delta state as the chunk's last row left
        it (a zero beta writes nothing, a zero g decays nothing); the conv keeps the last K - 1
        inputs up to row n, gathered on the device. Every shape is fixed: one capture serves
        every chunk of the bucket. -> o [P, value heads, Dv]."""
        st, w = states_of(kv), self.ssm_conv1d.value
        n = batch.plans[("query_start_i32",)][1].long()
        real = (batch.plans[("row_sequences",)] == 0)[:, None]  # [P, 1]
        zero = torch.zeros((), dtype=g.dtype, device=g.device)
        g, beta = torch.where(real, g, zero), torch.where(real, beta, zero)
        conv, ssm = st.read(layer, "conv", batch), st.read(layer, "ssm", batch)  # [2, ...]
        full = torch.cat((conv[0].float(), qkv.float()))  # [K - 1 + P, C], before the conv
        mixed = causal_conv_prefill(qkv, w, conv[0])  # (leaves the state past the padding:)
        conv[0] = full.index_select(0, n + torch.arange(w.shape[1] - 1, device=n.device))
        q, k, v = self._heads(*self._split(mixed))
        o = delta_rule_chunked(q, k, v, g, beta, ssm[0])  # the chunk's state, in place
        st.write(layer, "conv", batch, conv)
        st.write(layer, "ssm", batch, ssm)
        return o

    def _project(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q/k/v into the conv [T, conv_dim], z [T, value_dim]) from either layout."""
        if not self.ssm_in.loaded:
            return self.attn_qkv(h), self.attn_gate(h)
        a = self.args
        t, dk, vz = h.shape[0], a.head_k_dim, a.value_dim // a.n_k_heads
        mixed = self.ssm_in(h).view(t, a.n_k_heads, 2 * dk + 2 * vz)
        q, k, v, z = mixed.split([dk, dk, vz, vz], dim=-1)
        qkv = torch.cat([x.reshape(t, -1) for x in (q, k, v)], dim=1)
        return qkv, z.reshape(t, a.value_dim)

    def _split(self, mixed: torch.Tensor):
        """q, k [L, Hk, Dk] and v [L, Hv, Dv] from the conv's output [L, conv_dim]."""
        a = self.args
        n, L = a.n_k_heads * a.head_k_dim, mixed.shape[0]
        q, k = mixed[:, :n].view(L, a.n_k_heads, -1), mixed[:, n : 2 * n].view(L, a.n_k_heads, -1)
        return q, k, mixed[:, 2 * n :].view(L, a.n_v_heads, a.head_v_dim)

    def _heads(self, q, k, v):
        """q, k normalised, each key head repeated for its value heads, q scaled by 1/sqrt(Dk)."""
        a = self.args
        rep = a.n_v_heads // a.n_k_heads
        q = l2_normalize(q, a.norm_eps).repeat_interleave(rep, dim=1) * a.head_k_dim**-0.5
        return q, l2_normalize(k, a.norm_eps).repeat_interleave(rep, dim=1), v


class Model(Decoder):
    # prompt graphs: the DeltaNet layers take a padded chunk's layout from the device
    state_in_prompt_graphs = True
    tensor_aliases = {  # noqa: RUF012 (a class constant the loader reads)
        **Decoder.tensor_aliases,
        "post_attention_norm": "ffn_norm",
        **{n: f"mlp.{n}" for n in ("ffn_gate_inp", *EXPERT_TENSORS)},
        **{f"ffn_{p}_shexp": f"shexp.ffn_{p}" for p in ("gate", "up", "down")},
    }

    def __init__(self, args: ModelArgs, precise: bool = False):
        blocks, n_attn = [], 0
        for i in range(args.n_layers):
            if args.recurrent(i):
                blocks.append(DeltaNetBlock(args, i, precise))
            else:
                blocks.append(AttentionBlock(args, i, n_attn, precise))
                n_attn += 1
        super().__init__(args, blocks, precise)
        self.n_attn_layers = n_attn
        # a DeltaNet layer has attn_qkv + attn_gate, or a legacy ssm_in (`finish_load` checks)
        projections = ("attn_qkv", "attn_gate", "ssm_in")
        self.optional_tensors = (*Decoder.optional_tensors,
                                 *(f"blk.{i}.{n}.weight" for i in range(args.n_layers)
                                   if args.recurrent(i) for n in projections))  # fmt: skip

    def kv_shape(self) -> tuple[int, int, int]:
        """Only the full-attention layers keep K/V: (their count, kv heads, head dim)."""
        return max(self.n_attn_layers, 1), self.args.n_kv_heads, self.args.head_dim

    def state_shapes(self) -> dict[int, dict[str, tuple[int, ...]]]:
        """The DeltaNet layers' per-sequence state (`engine.runtime.recurrent_state`): the conv's
        last inputs [K - 1, conv_dim] and the delta state [value heads, Dk, Dv]."""
        return {i: b.state_shape() for i, b in enumerate(self.blk) if isinstance(b, DeltaNetBlock)}

    def finish_load(self, extra: dict[str, torch.Tensor]) -> None:
        """Called by the loader after every tensor is in place."""
        self.tie_output()
        a = self.args
        self.rotary = Rotary(RopeConfig(a.rope_dims, a.rope_base, neox=True,
                                        linear_scale=a.rope_linear_scale))  # fmt: skip
        for i, blk in enumerate(self.blk):
            if isinstance(blk, DeltaNetBlock):
                split = blk.attn_qkv.loaded and blk.attn_gate.loaded
                if split == blk.ssm_in.loaded or blk.attn_qkv.loaded != blk.attn_gate.loaded:
                    raise ValueError(f"blk.{i}: expected attn_qkv and attn_gate, or ssm_in alone")
            blk.fuse()
            blk.mlp.fuse()
