"""`decode_step_reference`: `kernels/cpu/decode_step.c`'s step in torch, layer by layer (each
linear's int8 math by `block_rows_reference`, the KV cache and the conv states written as the C
writes them): the oracle of tests/kernels/test_cpu_decode_step.py and test_cpu_decode_lfm2.py."""

import torch
import torch.nn.functional as F

from localllm.kernels.cpu.decode_step import LayerSpec, Shape
from localllm.kernels.quant.linear_native import block_rows_reference


def decode_step_reference(shape: Shape, layers: list[LayerSpec], block_size: int,
                          x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          slots: torch.Tensor, seq_lens: torch.Tensor, tables: torch.Tensor,
                          cos1: torch.Tensor | None = None,
                          sin1: torch.Tensor | None = None,
                          state_slots: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The step in torch (each linear's int8 math by `block_rows_reference`, the cache and the
    conv states written as the C does): x [t, dim] -> the stream after the last layer."""
    s, x = shape, x.clone()

    def mm(lin, v):  # a NativeLinear's int8-activation product, as the C computes it
        return block_rows_reference(v, lin.parts.parts, lin.qtype, lin.shape[1]).float()

    nq, nkv, hd = s.n_q, s.n_kv, s.head_dim
    half = s.rope_dims // 2

    tables_cs = ((cos, sin), (cos, sin) if cos1 is None else (cos1, sin1))
    scale = hd**-0.5 if s.scale is None else s.scale

    def rope(v, cs):  # [t, heads, hd]
        cos, sin = cs
        r = v[..., : s.rope_dims]
        a, b = (r[..., :half], r[..., half:]) if s.neox else (r[..., 0::2], r[..., 1::2])
        c, sn = cos[:, None, :], sin[:, None, :]
        ra, rb = a * c - b * sn, b * c + a * sn
        out = torch.cat((ra, rb), -1) if s.neox else torch.stack((ra, rb), -1).flatten(-2)
        return torch.cat((out, v[..., s.rope_dims :]), -1)

    def norm(v, w):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + s.eps) * w

    for lay in layers:
        h = norm(x, lay.attn_norm)
        if lay.conv_w is not None:  # LFM2's gated short conv (engine/models/lfm2.py's ShortConv)
            b, c, xv = mm(lay.qkv[0], h).split(s.dim, -1)
            full = torch.cat((lay.conv_state[state_slots], (b * xv)[:, None]), 1)
            lay.conv_state[state_slots] = full[:, 1:]
            x = x + mm(lay.o, c * (full * lay.conv_w.t()[None]).sum(1))
            x = _mlp(s, lay, x, mm, norm)
            continue
        qkv = torch.cat([mm(g, h) for g in lay.qkv], -1)
        qkv = qkv if lay.qkv_bias is None else qkv + lay.qkv_bias
        q = qkv[:, : nq * hd].reshape(-1, nq, hd)
        k = qkv[:, nq * hd : (nq + nkv) * hd].reshape(-1, nkv, hd)
        q = q if lay.q_norm is None else norm(q, lay.q_norm)
        k = k if lay.k_norm is None else norm(k, lay.k_norm)
        q, k = rope(q, tables_cs[lay.rope_set]), rope(k, tables_cs[lay.rope_set])
        v = qkv[:, (nq + nkv) * hd :].reshape(-1, nkv, hd)
        kc, vc = (c.view(-1, nkv, hd) for c in (lay.k_cache, lay.v_cache))
        kc[slots], vc[slots] = k.to(kc.dtype), v.to(vc.dtype)
        outs = []
        for i in range(x.shape[0]):
            n = int(seq_lens[i])
            pos = torch.arange(max(0, n - lay.window) if lay.window else 0, n)
            sl = tables[i][pos // block_size] * block_size + pos % block_size
            kk = kc[sl].float().repeat_interleave(nq // nkv, 1)  # [n, nq, hd]
            vv = vc[sl].float().repeat_interleave(nq // nkv, 1)
            sc = torch.einsum("hd,nhd->hn", q[i], kk) * scale
            if lay.sinks is not None:  # a key of its own per head, with no value
                sc = torch.cat((sc, lay.sinks[:, None]), -1)
            p = torch.softmax(sc, -1)[:, : len(pos)]
            outs.append(torch.einsum("hn,nhd->hd", p, vv).reshape(-1))
        o = mm(lay.o, torch.stack(outs))
        o = o if lay.o_bias is None else o + lay.o_bias
        x = x + (o if lay.post_attn_norm is None else norm(o, lay.post_attn_norm))
        x = _mlp(s, lay, x, mm, norm)
    return x


def _mlp(s: Shape, lay: LayerSpec, x: torch.Tensor, mm, norm) -> torch.Tensor:
    """The reference's gated MLP (or routed experts, and shared ones) and its residual add."""
    if lay.router is not None:
        h = norm(x, lay.ffn_norm)
        y = _moe(lay, h)
        return x + (y if not lay.shared_gu else y + _gated(lay.shared_gu, lay.shared_down, h, mm))
    d = _gated(lay.gate_up, lay.down, norm(x, lay.ffn_norm), mm, s.act)
    return x + (d if lay.post_ffn_norm is None else norm(d, lay.post_ffn_norm))


def _gated(gate_up: list, down, h: torch.Tensor, mm, act: str = "silu") -> torch.Tensor:
    gu = torch.cat([mm(g, h) for g in gate_up], -1)
    g, u = gu.chunk(2, -1)
    a = F.silu(g) if act == "silu" else F.gelu(g, approximate="tanh")
    return mm(down, a * u)


def _moe(lay: LayerSpec, h: torch.Tensor) -> torch.Tensor:
    """The reference's routed experts on h [t, dim]: softmax or sigmoid scores, the top k (on
    score + choice bias), their FFNs' int8 math (SiLU, or gpt-oss's biases and clamped SwiGLU),
    summed by weight in routing order."""
    gate, up, down = lay.experts
    tg, td = lay.exp_types[0], lay.exp_types[2]
    logits = h @ lay.router.T
    logits = logits if lay.router_bias is None else logits + lay.router_bias
    scores = torch.sigmoid(logits) if lay.scoring == "sigmoid" else torch.softmax(logits, -1)
    choice = scores if lay.probs_bias is None else scores + lay.probs_bias
    ids = choice.topk(lay.n_used, -1).indices
    w = scores.gather(1, ids)
    w = (w / w.sum(-1, keepdim=True) if lay.norm_topk else w) * lay.w_scale
    zero = torch.zeros(1)
    out = torch.zeros_like(h)
    for i in range(h.shape[0]):
        for j, e in enumerate(ids[i].tolist()):
            bg, bu, bd = (zero,) * 3 if lay.exp_bias is None else (b[e] for b in lay.exp_bias)
            g = block_rows_reference(h[i : i + 1], [gate[e]], tg, h.shape[1]).float() + bg
            u = block_rows_reference(h[i : i + 1], [up[e]], tg, h.shape[1]).float() + bu
            if lay.exp_act == "swiglu_oai":
                g, u = g.clamp(max=7.0), u.clamp(-7.0, 7.0)
                a = g * torch.sigmoid(1.702 * g) * (u + 1)
            else:
                a = F.silu(g) * u
            d = block_rows_reference(a, [down[e]], td, gate.shape[1]).float() + bd
            out[i] += w[i, j] * d[0]
    return out
