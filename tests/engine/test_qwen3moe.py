"""The `qwen3moe` family on a tiny random GGUF: logits vs transformers' Qwen3MoeForCausalLM on
the same file, KV-cache decode vs full recompute, a batch of two vs each alone.

transformers' GGUF reader ignores `expert_feed_forward_length` and `attention.key_length` for
qwen3moe, so both are passed explicitly. Both sides compute in float32 (LOGIT_TOL).
"""

import itertools

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from localllm.engine.batch import BatchMeta
from localllm.engine.gguf import open_gguf
from localllm.engine.kv_cache import PagedKVCache
from localllm.engine.loader import build_model
from localllm.engine.moe import MoEFeedForward
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
