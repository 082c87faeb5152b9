"""VITS text encoder in plain torch: symbol embedding, relative-position self-attention
(windowed, shared across heads), ReLU conv FFN, post-norm LayerNorm, and the prior projection.

Inference only, one utterance at a time (batch 1, no padding), so masks are all ones and left out.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from localllm.media.tts.onnx_weights import PiperWeights


def channel_layer_norm(
    x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, eps: float = 1e-5
) -> torch.Tensor:
    """LayerNorm over the channel axis of a [B, C, T] tensor (VITS `modules.LayerNorm`)."""
    y = F.layer_norm(x.transpose(1, -1), (x.shape[1],), gamma, beta, eps)
    return y.transpose(1, -1)


def _relative_embeddings(emb: torch.Tensor, length: int, window: int) -> torch.Tensor:
    """Slice or zero-pad the [1, 2W+1, D] table to the 2L-1 offsets a length-L sequence needs."""
    pad = max(length - (window + 1), 0)
    start = max((window + 1) - length, 0)
    if pad > 0:
        emb = F.pad(emb, [0, 0, pad, pad, 0, 0])
    return emb[:, start : start + 2 * length - 1]


def _relative_to_absolute(x: torch.Tensor) -> torch.Tensor:
    """[B, H, L, 2L-1] logits indexed by offset -> [B, H, L, L] indexed by key position."""
    b, h, length, _ = x.shape
    x = F.pad(x, [0, 1])
    flat = F.pad(x.reshape(b, h, length * 2 * length), [0, length - 1])
    return flat.view(b, h, length + 1, 2 * length - 1)[:, :, :length, length - 1 :]


def _absolute_to_relative(x: torch.Tensor) -> torch.Tensor:
    """[B, H, L, L] weights by key position -> [B, H, L, 2L-1] by offset."""
    b, h, length, _ = x.shape
    x = F.pad(x, [0, length - 1])
    flat = F.pad(x.reshape(b, h, length**2 + length * (length - 1)), [length, 0])
    return flat.view(b, h, length, 2 * length)[:, :, :, 1:]


def relative_attention(w: PiperWeights, prefix: str, x: torch.Tensor) -> torch.Tensor:
    """VITS `MultiHeadAttention(x, x)` with relative keys/values, window from the table size."""
    emb_k = w.tensor(f"{prefix}.emb_rel_k")
    emb_v = w.tensor(f"{prefix}.emb_rel_v")
    window = (emb_k.shape[1] - 1) // 2
    d_head = emb_k.shape[2]
    b, channels, length = x.shape
    heads = channels // d_head

    def split(t: torch.Tensor) -> torch.Tensor:
        return t.view(b, heads, d_head, length).transpose(2, 3)

    q = split(w.conv(f"{prefix}.conv_q")(x)) / math.sqrt(d_head)
    k = split(w.conv(f"{prefix}.conv_k")(x))
    v = split(w.conv(f"{prefix}.conv_v")(x))
    scores = q @ k.transpose(-2, -1)
    rel_k = _relative_embeddings(emb_k, length, window)
    scores = scores + _relative_to_absolute(q @ rel_k.unsqueeze(0).transpose(-2, -1))
    p = torch.softmax(scores, dim=-1)
    out = p @ v
    rel_v = _relative_embeddings(emb_v, length, window)
    out = out + _absolute_to_relative(p) @ rel_v.unsqueeze(0)
    out = out.transpose(2, 3).contiguous().view(b, channels, length)
    return w.conv(f"{prefix}.conv_o")(out)


def _same(x: torch.Tensor, kernel: int) -> torch.Tensor:
    # VITS FFN pads outside the conv (an ONNX Pad node), so the conv spec has padding 0
    return F.pad(x, [(kernel - 1) // 2, kernel // 2])


def _ffn(w: PiperWeights, prefix: str, x: torch.Tensor) -> torch.Tensor:
    c1, c2 = w.conv(f"{prefix}.conv_1"), w.conv(f"{prefix}.conv_2")
    x = torch.relu(c1(_same(x, c1.weight.shape[-1])))
    return c2(_same(x, c2.weight.shape[-1]))


def text_encoder(
    w: PiperWeights, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Phoneme ids [1, T] -> (hidden x, prior mean m_p, prior log-std logs_p), each [1, C, T]."""
    emb = w.tensor("enc_p.emb.weight")
    x = F.embedding(ids, emb) * math.sqrt(emb.shape[1])
    x = x.transpose(1, -1)
    layer = 0
    while f"enc_p.encoder.attn_layers.{layer}.emb_rel_k" in w.tensors:
        p = "enc_p.encoder"
        y = relative_attention(w, f"{p}.attn_layers.{layer}", x)
        x = channel_layer_norm(
            x + y,
            w.tensor(f"{p}.norm_layers_1.{layer}.gamma"),
            w.tensor(f"{p}.norm_layers_1.{layer}.beta"),
        )
        y = _ffn(w, f"{p}.ffn_layers.{layer}", x)
        x = channel_layer_norm(
            x + y,
            w.tensor(f"{p}.norm_layers_2.{layer}.gamma"),
            w.tensor(f"{p}.norm_layers_2.{layer}.beta"),
        )
        layer += 1
    if layer == 0:
        raise ValueError("voice has no text encoder layers")
    stats = w.conv("enc_p.proj")(x)
    m_p, logs_p = stats.chunk(2, dim=1)
    return x, m_p, logs_p
