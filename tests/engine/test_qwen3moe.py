"""The `qwen3moe` family on a tiny random GGUF: logits vs transformers' Qwen3MoeForCausalLM on
the same file, KV-cache decode vs full recompute, a batch of two vs each alone.

transformers' GGUF reader ignores `expert_feed_forward_length` and `attention.key_length` for
qwen3moe, so both are passed explicitly. Both sides compute in float32 (LOGIT_TOL).
"""

import itertools

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from localllm.engine.core.batch import BatchMeta
from localllm.engine.gguf import open_gguf
from localllm.engine.loader import build_model
from localllm.engine.moe.block import MoEFeedForward
from localllm.engine.runtime.kv_cache import PagedKVCache
from tests.offload.tiny_moe import QWEN3MOE, MoESpec, write_moe_gguf

LOGIT_TOL = 1e-4  # fp32 vs fp32 (measured 9.4e-6)
CACHE_TOL = 2e-5
BLOCK = 4
SEQ = 40
SPECS = {"f32": QWEN3MOE, "q8_0": MoESpec(expert_qtype=QT.Q8_0)}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3moe")
    return d, {k: write_moe_gguf(d / f"{k}.gguf", s) for k, s in SPECS.items()}


@pytest.fixture(scope="module")
def ours(files):
    opened = {k: open_gguf(p) for k, p in files[1].items()}
    yield {k: build_model(g, precise=True) for k, g in opened.items()}
    for g in opened.values():
        g.close()


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


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


def test_model_is_moe(ours):
    m = ours["f32"]
    assert all(isinstance(b.mlp, MoEFeedForward) for b in m.blk)
    assert m.blk[1].mlp.layer == 1 and m.args.n_expert == 8 and m.args.n_expert_used == 2


@pytest.mark.parametrize("kind", list(SPECS))
def test_logits_match_transformers(kind, files, ours):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    spec = SPECS[kind]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        files[0],
        gguf_file=f"{kind}.gguf",
        dtype=torch.float32,
        attn_implementation="eager",
        moe_intermediate_size=spec.expert_ff,
        head_dim=spec.head_dim,
    ).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    ids = tokens(SEQ, 1)
    with torch.inference_mode():
        want = hf(torch.tensor([ids])).logits[0]
    got = full_logits(ours[kind], ids)
    assert want.std() > 0.3
    err = (got - want).abs().max().item()
    assert err < LOGIT_TOL, f"{kind}: max |ours - transformers| = {err:.2e}"


@torch.inference_mode()
def test_cached_decode_matches_full_recompute(ours):
    model = ours["f32"]
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
    model = ours["f32"]
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


# -- Mixtral-style MoE in a `llama` GGUF -------------------------------------------------------


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's converter permutation of Q/K rows (NORM rope layout -> HF layout)."""
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _mixtral_reference(g, spec: MoESpec):
    """transformers' MixtralForCausalLM holding the GGUF's weights (its GGUF reader has no
    Mixtral mapping, so the state dict is built here)."""
    transformers = pytest.importorskip("transformers")
    from localllm.engine.layers.linear import dense

    cfg = transformers.MixtralConfig(
        vocab_size=spec.vocab,
        hidden_size=spec.dim,
        intermediate_size=spec.expert_ff,
        num_hidden_layers=spec.n_layers,
        num_attention_heads=spec.n_heads,
        num_key_value_heads=spec.n_kv_heads,
        head_dim=spec.head_dim,
        num_local_experts=spec.n_expert,
        num_experts_per_tok=spec.n_used,
        rms_norm_eps=1e-6,
        max_position_embeddings=spec.context,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_base},
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    hf = transformers.MixtralForCausalLM(cfg).eval()
    t = {name: dense(g.weight(name)) for name in g.tensors}
    sd = {
        "model.embed_tokens.weight": t["token_embd.weight"],
        "model.norm.weight": t["output_norm.weight"],
        "lm_head.weight": t["output.weight"],
    }
    for i in range(spec.n_layers):
        p, q = f"blk.{i}.", f"model.layers.{i}."
        sd[q + "input_layernorm.weight"] = t[p + "attn_norm.weight"]
        sd[q + "post_attention_layernorm.weight"] = t[p + "ffn_norm.weight"]
        sd[q + "self_attn.q_proj.weight"] = _unpermute(t[p + "attn_q.weight"], spec.n_heads)
        sd[q + "self_attn.k_proj.weight"] = _unpermute(t[p + "attn_k.weight"], spec.n_kv_heads)
        sd[q + "self_attn.v_proj.weight"] = t[p + "attn_v.weight"]
        sd[q + "self_attn.o_proj.weight"] = t[p + "attn_output.weight"]
        sd[q + "mlp.gate.weight"] = t[p + "ffn_gate_inp.weight"]
        gate_up = torch.cat((t[p + "ffn_gate_exps.weight"], t[p + "ffn_up_exps.weight"]), dim=1)
        sd[q + "mlp.experts.gate_up_proj"] = gate_up
        sd[q + "mlp.experts.down_proj"] = t[p + "ffn_down_exps.weight"]
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return hf


def test_mixtral_style_llama_matches_transformers(tmp_path):
    from tests.offload.tiny_moe import MIXTRAL

    path = write_moe_gguf(tmp_path / "mixtral.gguf", MIXTRAL)
    with open_gguf(path) as g:
        model = build_model(g, precise=True)
        assert isinstance(model.blk[1].mlp, MoEFeedForward) and model.blk[1].mlp.layer == 1
        hf = _mixtral_reference(g, MIXTRAL)
        ids = tokens(SEQ, 5)
        got = full_logits(model, ids)
    with torch.inference_mode():
        want = hf(torch.tensor([ids])).logits[0]
    assert want.std() > 0.3
    err = (got - want).abs().max().item()
    assert err < LOGIT_TOL, f"mixtral: max |ours - transformers| = {err:.2e}"
