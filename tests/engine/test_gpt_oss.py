"""The `gpt-oss` family on a tiny random GGUF (MXFP4 experts with biases, attention sinks,
sliding/full layers, YaRN, biased attention and router) vs transformers' GptOssForCausalLM
holding the same weights (the experts as dequantized from the file's MXFP4 blocks); sinks in
every paged-attention path vs the explicit formula; KV-cache decode vs full recompute; a batch
of two vs each alone.
"""

import itertools
import math

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from localllm.engine.core.batch import BatchMeta
from localllm.engine.gguf import open_gguf
from localllm.engine.loader import build_model
from localllm.engine.moe.block import MoEFeedForward
from localllm.engine.runtime.kv_cache import PagedKVCache
from localllm.kernels.attention import paged_attention, plan_decode
from tests.engine.tiny_models import write_gguf

LOGIT_TOL = 1e-4  # fp32 vs fp32 on the same dequantized weights
CACHE_TOL = 2e-5
BLOCK = 4
SEQ = 40
D, H, KVH, HD, NE, USED, EFF, VOCAB, LAYERS, WINDOW = 64, 4, 2, 16, 8, 2, 32, 256, 2, 8
YARN = {"factor": 4.0, "orig": 32}
META = {
    "block_count": LAYERS,
    "context_length": 128,
    "embedding_length": D,
    "feed_forward_length": EFF,
    "expert_feed_forward_length": EFF,
    "attention.head_count": H,
    "attention.head_count_kv": KVH,
    "attention.key_length": HD,
    "attention.value_length": HD,
    "attention.layer_norm_rms_epsilon": 1e-5,
    "attention.sliding_window": WINDOW,
    "rope.freq_base": 10000.0,
    "rope.dimension_count": HD,
    "rope.scaling.type": "yarn",
    "rope.scaling.factor": YARN["factor"],
    "rope.scaling.original_context_length": YARN["orig"],
    "expert_count": NE,
    "expert_used_count": USED,
    "vocab_size": VOCAB,
}


def _tensors(seed: int = 0) -> dict:
    """The GGUF's tensors: float32 arrays, the experts as (MXFP4 blocks, QT.MXFP4)."""
    rng = np.random.default_rng(seed)

    def w(*shape):
        return rng.standard_normal(shape, dtype=np.float32) / np.float32(math.sqrt(shape[-1]))

    def vec(*shape, s=0.3):
        return (s * rng.standard_normal(shape)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {
        "token_embd.weight": w(VOCAB, D),
        "output_norm.weight": norm(D),
        "output.weight": w(VOCAB, D),
    }
    for i in range(LAYERS):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = norm(D)
        for name, rows in (("attn_q", H * HD), ("attn_k", KVH * HD), ("attn_v", KVH * HD)):
            t[p + name + ".weight"], t[p + name + ".bias"] = w(rows, D), vec(rows)
        t[p + "attn_output.weight"], t[p + "attn_output.bias"] = w(D, H * HD), vec(D)
        t[p + "attn_sinks.weight"] = vec(H, s=1.0)
        t[p + "post_attention_norm.weight"] = norm(D)
        t[p + "ffn_gate_inp.weight"], t[p + "ffn_gate_inp.bias"] = 3 * w(NE, D), vec(NE)
        # x3: gate/up values past the clamp limit (7) occur, so the clamp is exercised
        for name, shape in (("gate", (NE, EFF, D)), ("up", (NE, EFF, D)), ("down", (NE, D, EFF))):
            arr = 3 * w(*shape)
            t[p + f"ffn_{name}_exps.weight"] = (gguf.quants.quantize(arr, QT.MXFP4), QT.MXFP4)
            t[p + f"ffn_{name}_exps.bias"] = vec(*shape[:2])
    return t


@pytest.fixture(scope="module")
def file(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("gptoss") / "m.gguf", "gpt-oss", META, _tensors())


@pytest.fixture(scope="module")
def ours(file):
    with open_gguf(file) as g:
        yield build_model(g, precise=True)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def new_cache(model, blocks: int) -> PagedKVCache:
    layers, kv_heads, head_dim = model.kv_shape()
    return PagedKVCache(layers, blocks, BLOCK, kv_heads, head_dim, dtype="f32")


@torch.inference_mode()
def full_logits(model, ids: list[int]) -> torch.Tensor:
    n = len(ids)
    batch = BatchMeta.contiguous(n, n, BLOCK)
    return model.logits(
        model(torch.tensor(ids), torch.arange(n), batch, new_cache(model, -(-n // BLOCK)))
    )


def _reference():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=D,
        intermediate_size=EFF,
        num_hidden_layers=LAYERS,
        num_attention_heads=H,
        num_key_value_heads=KVH,
        head_dim=HD,
        num_local_experts=NE,
        num_experts_per_tok=USED,
        sliding_window=WINDOW,
        rms_norm_eps=1e-5,
        max_position_embeddings=128,
        attention_bias=True,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": YARN["factor"],
            "original_max_position_embeddings": YARN["orig"],
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    hf = transformers.GptOssForCausalLM(cfg).eval()
    t = {
        k: torch.from_numpy(gguf.quants.dequantize(*v) if isinstance(v, tuple) else v)
        for k, v in _tensors().items()
    }
    sd = {
        "model.embed_tokens.weight": t["token_embd.weight"],
        "model.norm.weight": t["output_norm.weight"],
        "lm_head.weight": t["output.weight"],
    }
    for i in range(LAYERS):
        p, q = f"blk.{i}.", f"model.layers.{i}."
        sd[q + "input_layernorm.weight"] = t[p + "attn_norm.weight"]
        sd[q + "post_attention_layernorm.weight"] = t[p + "post_attention_norm.weight"]
        for hf_name, name in (
            ("q", "attn_q"),
            ("k", "attn_k"),
            ("v", "attn_v"),
            ("o", "attn_output"),
        ):
            for s in ("weight", "bias"):
                sd[q + f"self_attn.{hf_name}_proj.{s}"] = t[p + f"{name}.{s}"]
        sd[q + "self_attn.sinks"] = t[p + "attn_sinks.weight"]
        sd[q + "mlp.router.weight"] = t[p + "ffn_gate_inp.weight"]
        sd[q + "mlp.router.bias"] = t[p + "ffn_gate_inp.bias"]
        # transformers interleaves gate and up on the last axis and stores inputs first
        gate_up = torch.stack((t[p + "ffn_gate_exps.weight"], t[p + "ffn_up_exps.weight"]), -2)
        sd[q + "mlp.experts.gate_up_proj"] = gate_up.reshape(NE, 2 * EFF, D).transpose(1, 2)
        bias = torch.stack((t[p + "ffn_gate_exps.bias"], t[p + "ffn_up_exps.bias"]), -1)
        sd[q + "mlp.experts.gate_up_proj_bias"] = bias.reshape(NE, 2 * EFF)
        sd[q + "mlp.experts.down_proj"] = t[p + "ffn_down_exps.weight"].transpose(1, 2)
        sd[q + "mlp.experts.down_proj_bias"] = t[p + "ffn_down_exps.bias"]
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return hf


def test_structure(ours):
    assert [b.window for b in ours.blk] == [WINDOW, None]
    moe = ours.blk[1].mlp
    assert isinstance(moe, MoEFeedForward) and moe.layer == 1
    assert moe.format.gate.name == "MXFP4" and moe.format.act == "swiglu_oai"
    assert moe.ffn_down_exps.bias.shape == (NE, D)


def test_logits_match_transformers(ours):
    hf = _reference()
    ids = tokens(SEQ, 1)
    with torch.inference_mode():
        want = hf(torch.tensor([ids])).logits[0]
    got = full_logits(ours, ids)
    assert want.std() > 0.3
    err = (got - want).abs().max().item()
    assert err < LOGIT_TOL, f"max |ours - transformers| = {err:.2e}"


def _explicit(q, keys, vals, sinks, window, n):
    """Sink attention of the last len(q) queries of an n-token sequence, written out."""
    out = []
    group = q.shape[1] // keys.shape[1]
    kk, vv = keys.repeat_interleave(group, 1), vals.repeat_interleave(group, 1)
    for i in range(q.shape[0]):
        pos = n - q.shape[0] + i
        lo = max(0, pos - window + 1) if window else 0
        s = torch.einsum("hd,mhd->hm", q[i], kk[lo : pos + 1]) * 0.25
        p = torch.softmax(torch.cat((s, sinks[:, None]), -1), -1)[:, :-1]
        out.append(torch.einsum("hm,mhd->hd", p, vv[lo : pos + 1]))
    return torch.stack(out)


@pytest.mark.parametrize("window", [None, 5])
def test_sinks_in_every_attention_path(window):
    """Prefill chunk, single decode and the batched decode plan all match the formula."""
    g = torch.Generator().manual_seed(0)
    lens = (13, 9, 11)
    kc, vc = torch.randn(2, 12, BLOCK, KVH, HD, generator=g).unbind(0)
    tables = ((0, 1, 2, 3), (4, 5, 6), (7, 8, 9))
    sinks = torch.randn(H, generator=g)
    for t in ((6, 1, 1), (1, 1, 1), (1, 4, 2)):
        q = torch.randn(sum(t), H, HD, generator=g)
        starts = (0, *itertools.accumulate(t))
        plan = plan_decode(starts, lens, tables, BLOCK, window)
        got = paged_attention(q, kc, vc, starts, lens, tables, 0.25, window, sinks=sinks)
        planned = paged_attention(
            q, kc, vc, starts, lens, tables, 0.25, window, decode=plan, sinks=sinks
        )
        for b, n in enumerate(lens):
            keys = kc[list(tables[b])].flatten(0, 1)[:n]
            vals = vc[list(tables[b])].flatten(0, 1)[:n]
            want = _explicit(q[starts[b] : starts[b + 1]], keys, vals, sinks, window, n)
            assert torch.allclose(got[starts[b] : starts[b + 1]], want, atol=1e-5), (t, b)
            assert torch.allclose(planned[starts[b] : starts[b + 1]], want, atol=1e-5), (t, b)
        plain = paged_attention(q, kc, vc, starts, lens, tables, 0.25, window)
        assert (plain - got).abs().max() > 1e-3  # the sinks matter on these values


@torch.inference_mode()
def test_cached_decode_matches_full_recompute(ours):
    ids = tokens(SEQ, 2)
    want = full_logits(ours, ids)
    kv = new_cache(ours, SEQ // BLOCK)
    for s, e in itertools.pairwise([0, 13, 20, *range(21, SEQ + 1)]):
        h = ours(
            torch.tensor(ids[s:e]), torch.arange(s, e), BatchMeta.contiguous(e - s, e, BLOCK), kv
        )
        err = (ours.logits(h) - want[s:e]).abs().max().item()
        assert err < CACHE_TOL, f"tokens {s}..{e}: {err:.2e}"


@torch.inference_mode()
def test_batch_of_two_matches_each_alone(ours):
    a, b = tokens(11, 3), tokens(23, 4)
    kv = new_cache(ours, 12)
    tables = ((7, 2, 10), (5, 0, 9, 3, 11, 1))
    pos = torch.cat((torch.arange(11), torch.arange(17)))
    batch = BatchMeta.from_tables((11, 17), (11, 17), tables, BLOCK)
    out = ours.logits(ours(torch.tensor(a + b[:17]), pos, batch, kv))
    assert (out[:11] - full_logits(ours, a)).abs().max() < CACHE_TOL
    want_b = full_logits(ours, b)
    assert (out[11:] - want_b[:17]).abs().max() < CACHE_TOL
    # both decode one token: the batched decode plan with sinks and a window
    a2 = [*a, b[0]]
    batch = BatchMeta.from_tables((1, 1), (12, 18), tables, BLOCK)
    out = ours.logits(ours(torch.tensor([a2[11], b[17]]), torch.tensor([11, 17]), batch, kv))
    assert (out[0] - full_logits(ours, a2)[11]).abs().max() < CACHE_TOL
    assert (out[1] - want_b[17]).abs().max() < CACHE_TOL


def write_gpt_oss(path, seed: int = 0):
    """This file's tiny gpt-oss GGUF at `path` (for other suites)."""
    return write_gguf(path, "gpt-oss", META, _tensors(seed))
