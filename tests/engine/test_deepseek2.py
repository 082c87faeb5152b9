"""The `deepseek2` family on a tiny random GGUF (V3 layout: low-rank q, MLA kv, one dense layer,
sigmoid grouped routing with exp_probs_b, a shared expert, YaRN) vs transformers'
DeepseekV3ForCausalLM holding the same weights; the split attn_k_b/attn_v_b layout vs the merged
attn_kv_b; decode over the latent KV cache (one shared head of kv_lora + rope values, V the latent)
vs full recompute; a batch of two vs each alone.

transformers' GGUF reader has no deepseek2 mapping, so its state dict is built here.
"""

import itertools
import math

import numpy as np
import pytest
import torch

from localllm.engine.core.batch import BatchMeta
from localllm.engine.gguf import open_gguf
from localllm.engine.loader import build_model
from localllm.engine.models.deepseek2 import Attention
from localllm.engine.moe.block import MoEFeedForward
from localllm.engine.runtime.kv_cache import PagedKVCache
from tests.engine.tiny_models import write_gguf

LOGIT_TOL = 1e-4  # fp32 vs fp32
CACHE_TOL = 2e-5
BLOCK = 4
SEQ = 40
D, H, QL, KVL, NOPE, ROPE, V = 64, 4, 32, 32, 16, 8, 16
LAYERS, DENSE_FF, NE, USED, EFF, VOCAB = 3, 96, 8, 2, 32, 256
GROUPS, GROUPS_USED, SCALE = 4, 2, 2.5
YARN = {"factor": 4.0, "orig": 32}
META = {
    "block_count": LAYERS,
    "context_length": 128,
    "embedding_length": D,
    "feed_forward_length": DENSE_FF,
    "attention.head_count": H,
    "attention.head_count_kv": H,
    "attention.layer_norm_rms_epsilon": 1e-6,
    "attention.q_lora_rank": QL,
    "attention.kv_lora_rank": KVL,
    "attention.key_length": NOPE + ROPE,
    "attention.value_length": V,
    "rope.dimension_count": ROPE,
    "rope.freq_base": 10000.0,
    "rope.scaling.type": "yarn",
    "rope.scaling.factor": YARN["factor"],
    "rope.scaling.original_context_length": YARN["orig"],
    "rope.scaling.yarn_log_multiplier": 0.1,
    "leading_dense_block_count": 1,
    "expert_count": NE,
    "expert_used_count": USED,
    "expert_feed_forward_length": EFF,
    "expert_shared_count": 1,
    "expert_weights_scale": SCALE,
    "expert_weights_norm": True,
    "expert_gating_func": 2,
    "expert_group_count": GROUPS,
    "expert_group_used_count": GROUPS_USED,
    "vocab_size": VOCAB,
}


# V2-Lite style: plain attn_q, softmax routing without renormalisation, one group, no bias, no
# YaRN
V2_META = {
    k: v
    for k, v in META.items()
    if not k.startswith(("rope.scaling", "attention.q_lora", "expert_group"))
} | {"expert_gating_func": 1, "expert_weights_norm": False}


def _tensors(seed: int = 0, v2: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def w(*shape):
        return rng.standard_normal(shape, dtype=np.float32) / np.float32(math.sqrt(shape[-1]))

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {"token_embd.weight": w(VOCAB, D), "output_norm.weight": norm(D)}
    t["output.weight"] = w(VOCAB, D)
    for i in range(LAYERS):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = norm(D)
        if v2:
            t[p + "attn_q.weight"] = w(H * (NOPE + ROPE), D)
        else:
            t[p + "attn_q_a.weight"] = w(QL, D)
            t[p + "attn_q_a_norm.weight"] = norm(QL)
            t[p + "attn_q_b.weight"] = w(H * (NOPE + ROPE), QL)
        t[p + "attn_kv_a_mqa.weight"] = w(KVL + ROPE, D)
        t[p + "attn_kv_a_norm.weight"] = norm(KVL)
        t[p + "attn_kv_b.weight"] = w(H * (NOPE + V), KVL)
        t[p + "attn_output.weight"] = w(D, H * V)
        t[p + "ffn_norm.weight"] = norm(D)
        if i == 0:
            t[p + "ffn_gate.weight"], t[p + "ffn_up.weight"] = w(DENSE_FF, D), w(DENSE_FF, D)
            t[p + "ffn_down.weight"] = w(D, DENSE_FF)
            continue
        t[p + "ffn_gate_inp.weight"] = 3 * w(NE, D)
        # a choice bias as large as the score spread: it must change which experts run
        if not v2:
            t[p + "exp_probs_b.bias"] = (0.3 * rng.standard_normal(NE)).astype(np.float32)
        t[p + "ffn_gate_exps.weight"] = w(NE, EFF, D)
        t[p + "ffn_up_exps.weight"] = w(NE, EFF, D)
        t[p + "ffn_down_exps.weight"] = w(NE, D, EFF)
        t[p + "ffn_gate_shexp.weight"] = w(EFF, D)
        t[p + "ffn_up_shexp.weight"] = w(EFF, D)
        t[p + "ffn_down_shexp.weight"] = w(D, EFF)
    return t


def _split(t: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The newer GGUF layout: attn_kv_b split per head into k_b [H, kv_lora, nope] (transposed)
    and v_b [H, v, kv_lora], as llama.cpp's converter writes them."""
    out = {}
    for name, arr in t.items():
        if name.endswith("attn_kv_b.weight"):
            kv = arr.reshape(H, NOPE + V, KVL)
            out[name.replace("attn_kv_b", "attn_k_b")] = np.ascontiguousarray(
                kv[:, :NOPE].transpose(0, 2, 1)
            )
            out[name.replace("attn_kv_b", "attn_v_b")] = np.ascontiguousarray(kv[:, NOPE:])
        else:
            out[name] = arr
    return out


SPLIT_META = {
    **META,
    "attention.key_length": KVL + ROPE,
    "attention.value_length": KVL,
    "attention.key_length_mla": NOPE + ROPE,
    "attention.value_length_mla": V,
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("deepseek2")
    t = _tensors()
    return {
        "merged": write_gguf(d / "merged.gguf", "deepseek2", META, t),
        "split": write_gguf(d / "split.gguf", "deepseek2", SPLIT_META, _split(t)),
        "v2": write_gguf(d / "v2.gguf", "deepseek2", V2_META, _tensors(v2=True)),
    }


@pytest.fixture(scope="module")
def ours(files):
    opened = {k: open_gguf(p) for k, p in files.items()}
    yield {k: build_model(g, precise=True) for k, g in opened.items()}
    for g in opened.values():
        g.close()


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def new_cache(model, blocks: int) -> PagedKVCache:
    layers, kv_heads, head_dim = model.kv_shape()
    vd = model.kv_value_dim()
    return PagedKVCache(layers, blocks, BLOCK, kv_heads, head_dim, dtype="f32", v_head_dim=vd)


@torch.inference_mode()
def full_logits(model, ids: list[int]) -> torch.Tensor:
    n = len(ids)
    batch = BatchMeta.contiguous(n, n, BLOCK)
    return model.logits(
        model(torch.tensor(ids), torch.arange(n), batch, new_cache(model, -(-n // BLOCK)))
    )


def _reference(v2: bool):
    transformers = pytest.importorskip("transformers")
    if v2:
        cfg = transformers.DeepseekV2Config(**_common_config(), q_lora_rank=None)
        cfg.topk_method, cfg.rope_parameters = "greedy", {"rope_type": "default", "rope_theta": 1e4}
        hf = transformers.DeepseekV2ForCausalLM(cfg).eval()
    else:
        hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**_v3_config()))
    return _load(hf.eval(), v2)


def _common_config() -> dict:
    return dict(
        vocab_size=VOCAB,
        hidden_size=D,
        intermediate_size=DENSE_FF,
        moe_intermediate_size=EFF,
        num_hidden_layers=LAYERS,
        num_attention_heads=H,
        num_key_value_heads=H,
        n_shared_experts=1,
        n_routed_experts=NE,
        num_experts_per_tok=USED,
        routed_scaling_factor=SCALE,
        kv_lora_rank=KVL,
        qk_rope_head_dim=ROPE,
        qk_nope_head_dim=NOPE,
        v_head_dim=V,
        first_k_dense_replace=1,
        rms_norm_eps=1e-6,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )


def _v3_config() -> dict:
    return _common_config() | dict(
        q_lora_rank=QL,
        n_group=GROUPS,
        topk_group=GROUPS_USED,
        norm_topk_prob=True,
        rope_interleave=True,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": YARN["factor"],
            "original_max_position_embeddings": YARN["orig"],
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        },
    )


def _load(hf, v2: bool):
    """Put the GGUF's weights into transformers' model."""
    t = {k: torch.from_numpy(v) for k, v in _tensors(v2=v2).items()}
    sd = {
        "model.embed_tokens.weight": t["token_embd.weight"],
        "model.norm.weight": t["output_norm.weight"],
        "lm_head.weight": t["output.weight"],
    }
    names = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_a_proj": "attn_q_a",
        "self_attn.q_a_layernorm": "attn_q_a_norm",
        "self_attn.q_b_proj": "attn_q_b",
        "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
        "self_attn.kv_a_layernorm": "attn_kv_a_norm",
        "self_attn.kv_b_proj": "attn_kv_b",
        "self_attn.o_proj": "attn_output",
    }
    if v2:
        names = {k: v for k, v in names.items() if "q_a" not in k and "q_b" not in k}
        names["self_attn.q_proj"] = "attn_q"
    for i in range(LAYERS):
        p, q = f"blk.{i}.", f"model.layers.{i}."
        for hf_name, ours_name in names.items():
            sd[q + hf_name + ".weight"] = t[p + ours_name + ".weight"]
        if i == 0:
            for n in ("gate", "up", "down"):
                sd[q + f"mlp.{n}_proj.weight"] = t[p + f"ffn_{n}.weight"]
            continue
        sd[q + "mlp.gate.weight"] = t[p + "ffn_gate_inp.weight"]
        if not v2:
            sd[q + "mlp.gate.e_score_correction_bias"] = t[p + "exp_probs_b.bias"]
        gate_up = torch.cat((t[p + "ffn_gate_exps.weight"], t[p + "ffn_up_exps.weight"]), dim=1)
        sd[q + "mlp.experts.gate_up_proj"] = gate_up
        sd[q + "mlp.experts.down_proj"] = t[p + "ffn_down_exps.weight"]
        for n in ("gate", "up", "down"):
            sd[q + f"mlp.shared_experts.{n}_proj.weight"] = t[p + f"ffn_{n}_shexp.weight"]
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return hf


def test_structure(ours):
    m = ours["merged"]
    assert not isinstance(m.blk[0].mlp, MoEFeedForward)
    moe = m.blk[2].mlp
    assert isinstance(moe, MoEFeedForward) and moe.layer == 2 and moe.shexp is not None
    assert moe.routing.scoring == "sigmoid" and moe.routing.n_group == GROUPS
    # the cache holds the latent: one shared KV head of kv_lora + rope, V the latent alone
    assert m.kv_shape() == (LAYERS, 1, KVL + ROPE) and m.kv_value_dim() == KVL
    assert not hasattr(m.blk[0].attn, "attn_kv_b")  # absorbed into k_b / v_b at load
    assert m.blk[0].attn.k_b.shape == (H, KVL, NOPE) and m.blk[0].attn.v_b.shape == (H, V, KVL)
    assert isinstance(m.blk[0].attn, Attention) and m.args.split_kv_b is False
    assert ours["split"].args.split_kv_b is True
    v2 = ours["v2"]
    assert v2.args.q_lora_rank == 0 and v2.blk[1].mlp.routing.scoring == "softmax"
    assert not v2.args.norm_topk_prob and not v2.blk[1].mlp.routing.probs_bias


@torch.inference_mode()
def test_routing_features_change_the_choice(ours):
    """The bias and the group limit each pick other experts on these inputs (so the comparison
    with transformers below would catch either being ignored)."""
    moe = ours["merged"].blk[1].mlp
    x = torch.randn(64, D, generator=torch.Generator().manual_seed(0))
    _, ids = moe.route(x)
    saved_bias, saved_routing = moe.exp_probs_b.value, moe.routing
    try:
        moe.exp_probs_b.value = torch.zeros(NE)
        _, no_bias = moe.route(x)
        moe.exp_probs_b.value = saved_bias
        moe.routing = type(saved_routing)(**{**saved_routing.__dict__, "n_group": 1})
        _, no_groups = moe.route(x)
    finally:
        moe.exp_probs_b.value, moe.routing = saved_bias, saved_routing
    same = lambda a, b: torch.equal(a.sort(-1)[0], b.sort(-1)[0])
    assert not same(ids, no_bias) and not same(ids, no_groups)


@pytest.mark.parametrize("kind", ["merged", "v2"])
def test_logits_match_transformers(kind, ours):
    hf = _reference(v2=kind == "v2")
    ids = tokens(SEQ, 1)
    with torch.inference_mode():
        want = hf(torch.tensor([ids])).logits[0]
    got = full_logits(ours[kind], ids)
    assert want.std() > 0.3
    err = (got - want).abs().max().item()
    assert err < LOGIT_TOL, f"{kind}: max |ours - transformers| = {err:.2e}"


def test_split_kv_b_matches_merged(ours):
    ids = tokens(SEQ, 6)
    err = (full_logits(ours["split"], ids) - full_logits(ours["merged"], ids)).abs().max()
    assert err < CACHE_TOL


@torch.inference_mode()
def test_cached_decode_matches_full_recompute(ours):
    model = ours["merged"]
    ids = tokens(SEQ, 2)
    want = full_logits(model, ids)
    kv = new_cache(model, SEQ // BLOCK)
    for s, e in itertools.pairwise([0, 13, 20, *range(21, SEQ + 1)]):
        h = model(
            torch.tensor(ids[s:e]), torch.arange(s, e), BatchMeta.contiguous(e - s, e, BLOCK), kv
        )
        err = (model.logits(h) - want[s:e]).abs().max().item()
        assert err < CACHE_TOL, f"tokens {s}..{e}: {err:.2e}"


@torch.inference_mode()
def test_batch_of_two_matches_each_alone(ours):
    model = ours["merged"]
    a, b = tokens(11, 3), tokens(23, 4)
    kv = new_cache(model, 12)
    tables = ((7, 2, 10), (5, 0, 9, 3, 11, 1))
    pos = torch.cat((torch.arange(11), torch.arange(17)))
    batch = BatchMeta.from_tables((11, 17), (11, 17), tables, BLOCK)
    out = model.logits(model(torch.tensor(a + b[:17]), pos, batch, kv))
    assert (out[:11] - full_logits(model, a)).abs().max() < CACHE_TOL
    want_b = full_logits(model, b)
    assert (out[11:] - want_b[:17]).abs().max() < CACHE_TOL
    a2 = [*a, b[0]]
    batch = BatchMeta.from_tables((1, 6), (12, 23), tables, BLOCK)
    ids = torch.tensor([a2[11], *b[17:]])
    out = model.logits(model(ids, torch.tensor([11, *range(17, 23)]), batch, kv))
    assert (out[0] - full_logits(model, a2)[11]).abs().max() < CACHE_TOL
    assert (out[1:] - want_b[17:]).abs().max() < CACHE_TOL


def write_deepseek2(path, seed: int = 0):
    """This file's tiny deepseek2 GGUF (merged attn_kv_b) at `path` (for other suites)."""
    return write_gguf(path, "deepseek2", META, _tensors(seed))
