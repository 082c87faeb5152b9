"""M-RoPE (`layers.rope.MRotary`) against transformers' own rotary embeddings: Qwen2.5-VL's
block sections and Qwen3-VL's interleaved ones give the same cos/sin for 3-axis positions, and
text positions (equal axes, or a flat [T]) are plain rope."""

import pytest
import torch

from localllm.engine.layers.rope import MRotary, RopeConfig, Rotary

HEAD = 128


def hf_cos_sin(kind: str, sections, positions: torch.Tensor):
    """transformers' cos/sin [T, HEAD/2] (one half of its duplicated layout) for [3, T]."""
    if kind == "blocks":
        from transformers import Qwen2_5_VLTextConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding

        rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": list(sections)}
        cfg = Qwen2_5_VLTextConfig(
            hidden_size=HEAD * 2, num_attention_heads=2, rope_parameters=rope
        )
        emb = Qwen2_5_VLRotaryEmbedding(cfg)
    else:
        from transformers import Qwen3VLTextConfig
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

        cfg = Qwen3VLTextConfig(hidden_size=HEAD * 2, num_attention_heads=2, head_dim=HEAD,
                                rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                 "mrope_section": list(sections),
                                                 "mrope_interleaved": True})  # fmt: skip
        emb = Qwen3VLTextRotaryEmbedding(cfg)
    x = torch.zeros(1, positions.shape[1], HEAD)
    cos, sin = emb(x, positions[:, None, :])
    return cos[0, :, : HEAD // 2], sin[0, :, : HEAD // 2]


@pytest.mark.parametrize(
    ("kind", "sections"), [("blocks", (16, 24, 24)), ("interleaved", (24, 20, 20))]
)
def test_cos_sin_equal_transformers(kind, sections):
    # (small positions: both compute angles in float32, from frequencies rounded differently)
    torch.manual_seed(0)
    pos = torch.randint(0, 200, (3, 40))
    rot = MRotary(RopeConfig(HEAD, 1e6, neox=True), sections, interleaved=kind == "interleaved")
    want = hf_cos_sin(kind, sections, pos)
    for got, ref in zip(rot.cos_sin(pos), want, strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=3e-5)


@pytest.mark.parametrize("interleaved", [False, True])
def test_text_positions_are_plain_rope(interleaved):
    pos = torch.arange(100, 140)
    rot = MRotary(RopeConfig(HEAD, 1e6, neox=True), (16, 24, 24), interleaved=interleaved)
    plain = Rotary(RopeConfig(HEAD, 1e6, neox=True)).cos_sin(pos)
    for a, b, c in zip(rot.cos_sin(pos.expand(3, -1)), rot.cos_sin(pos), plain, strict=True):
        torch.testing.assert_close(a, c, rtol=0, atol=0)
        torch.testing.assert_close(b, c, rtol=0, atol=0)
