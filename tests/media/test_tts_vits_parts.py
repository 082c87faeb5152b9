"""Parts of the torch VITS graph against independent plain-torch references on random weights:
relative-position attention (explicit per-offset loops instead of the pad/reshape tricks) and both
HiFi-GAN residual block layouts (nn.Conv1d modules, as in the HiFi-GAN paper's code)."""

import math

import pytest
import torch
import torch.nn.functional as F

from localllm.media.tts.onnx_weights import ConvSpec, PiperWeights, VoiceFormatError
from localllm.media.tts.vits import hifigan
from localllm.media.tts.vits_text import relative_attention


def conv(c_out: int, c_in: int, k: int, dilation: int = 1, gen=None) -> ConvSpec:
    return ConvSpec(
        weight=torch.randn(c_out, c_in, k, generator=gen) / math.sqrt(c_in * k),
        bias=torch.randn(c_out, generator=gen) * 0.1,
        stride=1,
        padding=(k * dilation - dilation) // 2,
        dilation=dilation,
        groups=1,
        transposed=False,
    )


@pytest.mark.parametrize("length", [1, 3, 5, 12])
def test_relative_attention_matches_explicit_offsets(length: int) -> None:
    gen = torch.Generator().manual_seed(length)
    channels, heads, window = 8, 2, 2
    d = channels // heads
    p = "a"
    w = PiperWeights(
        tensors={
            f"{p}.emb_rel_k": torch.randn(1, 2 * window + 1, d, generator=gen),
            f"{p}.emb_rel_v": torch.randn(1, 2 * window + 1, d, generator=gen),
        },
        convs={f"{p}.conv_{n}": conv(channels, channels, 1, gen=gen) for n in "qkvo"},
    )
    x = torch.randn(1, channels, length, generator=gen)
    ours = relative_attention(w, p, x)

    def heads_of(t: torch.Tensor) -> torch.Tensor:  # [C, L] -> [H, L, d]
        return t[0].view(heads, d, length).transpose(1, 2)

    q = heads_of(w.convs[f"{p}.conv_q"](x)) / math.sqrt(d)
    k = heads_of(w.convs[f"{p}.conv_k"](x))
    v = heads_of(w.convs[f"{p}.conv_v"](x))
    ek, ev = w.tensors[f"{p}.emb_rel_k"][0], w.tensors[f"{p}.emb_rel_v"][0]
    out = torch.zeros(heads, length, d)
    for h in range(heads):
        scores = torch.zeros(length, length)
        for i in range(length):
            for j in range(length):
                rel = j - i
                scores[i, j] = q[h, i] @ k[h, j]
                if abs(rel) <= window:
                    scores[i, j] += q[h, i] @ ek[rel + window]
        prob = torch.softmax(scores, dim=-1)
        for i in range(length):
            for j in range(length):
                rel = j - i
                out[h, i] += prob[i, j] * v[h, j]
                if abs(rel) <= window:
                    out[h, i] += prob[i, j] * ev[rel + window]
    ref = w.convs[f"{p}.conv_o"](out.transpose(1, 2).reshape(1, channels, length))
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def _decoder(block: str, gen: torch.Generator) -> PiperWeights:
    convs = {
        "dec.conv_pre": conv(16, 8, 7, gen=gen),
        "dec.ups.0": ConvSpec(
            torch.randn(16, 8, 4, generator=gen) * 0.2, torch.zeros(8), 2, 1, 1, 1, True
        ),
        "dec.conv_post": conv(1, 8, 7, gen=gen),
    }
    for r, k in enumerate((3, 5)):
        dil = (1, 3)
        if block == "2":
            for c in range(2):
                convs[f"dec.resblocks.{r}.convs.{c}"] = conv(8, 8, k, dil[c], gen)
        else:
            for c in range(2):
                convs[f"dec.resblocks.{r}.convs1.{c}"] = conv(8, 8, k, dil[c], gen)
                convs[f"dec.resblocks.{r}.convs2.{c}"] = conv(8, 8, k, 1, gen)
    return PiperWeights({}, convs)


def _reference_decoder(w: PiperWeights, block: str, z: torch.Tensor) -> torch.Tensor:
    def module(spec: ConvSpec) -> torch.nn.Module:
        cls = torch.nn.ConvTranspose1d if spec.transposed else torch.nn.Conv1d
        c_in, c_out = spec.weight.shape[:2] if spec.transposed else spec.weight.shape[1::-1]
        m = cls(c_in, c_out, spec.weight.shape[2], spec.stride, spec.padding,
                dilation=spec.dilation, bias=spec.bias is not None)  # fmt: skip
        m.weight.data.copy_(spec.weight)
        if spec.bias is not None:
            m.bias.data.copy_(spec.bias)
        return m

    c = {k: module(v) for k, v in w.convs.items()}
    x = c["dec.ups.0"](F.leaky_relu(c["dec.conv_pre"](z), 0.1))
    outs = []
    for r in range(2):
        y = x
        for i in range(2):
            if block == "2":
                y = y + c[f"dec.resblocks.{r}.convs.{i}"](F.leaky_relu(y, 0.1))
            else:
                t = c[f"dec.resblocks.{r}.convs1.{i}"](F.leaky_relu(y, 0.1))
                y = y + c[f"dec.resblocks.{r}.convs2.{i}"](F.leaky_relu(t, 0.1))
        outs.append(y)
    x = (outs[0] + outs[1]) / 2
    return torch.tanh(c["dec.conv_post"](F.leaky_relu(x, 0.01)))


@pytest.mark.parametrize("block", ["1", "2"])
def test_hifigan_blocks_match_reference(block: str) -> None:
    gen = torch.Generator().manual_seed(int(block))
    w = _decoder(block, gen)
    z = torch.randn(1, 8, 10, generator=gen)
    with torch.no_grad():
        ref = _reference_decoder(w, block, z)
    ours = hifigan(w, z)
    assert ours.shape == ref.shape == (1, 1, 20)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_unknown_residual_block_layout_is_an_error() -> None:
    gen = torch.Generator().manual_seed(0)
    w = _decoder("2", gen)
    convs = {k.replace(".convs.", ".weird."): v for k, v in w.convs.items()}
    with pytest.raises(VoiceFormatError, match="residual block"):
        hifigan(PiperWeights({}, convs), torch.randn(1, 8, 4))
