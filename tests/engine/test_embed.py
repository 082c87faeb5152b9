"""Embeddings from decoder models: pooled final hidden states, and the engine thread's interleaving.

- A tiny random llama GGUF: our batched, chunked scratch-cache forward pooled (last / mean) equals
  transformers' `last_hidden_state` (final norm included) on the same file, within 1e-4 (fp32).
- SmolLM2 (real, Q4_1, default kernels): `LLMEngine.embed` equals a plain-torch recomputation (one
  sequence per forward through the model, then pooling and L2 in torch) from the same model.
- `AsyncEngine.embed` while a greedy generation streams: the generation's tokens equal a run
  without embeddings, the embeddings equal the synchronous engine's, and the engine's KV blocks
  are all free afterwards (the scratch cache is separate).
"""

import asyncio

import pytest
import torch
import torch.nn.functional as F

from localllm.engine import AsyncEngine
from localllm.engine.config import EngineArgs
from localllm.engine.core.batch import BatchMeta
from localllm.engine.embedder import Embedder
from localllm.engine.gguf import open_gguf
from localllm.engine.llm_engine import LLMEngine
from localllm.engine.loader import build_model
from localllm.engine.runtime.kv_cache import PagedKVCache
from tests.engine.engine_fixtures import greedy
from tests.engine.tiny_models import SPECS, write_tiny_gguf

TEXTS = [
    "The capital of France is Paris.",
    "def add(a, b): return a + b",
    "Photosynthesis turns light into chemical energy in plants.",
]


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, SPECS["llama"].vocab, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("embed_llama")
    write_tiny_gguf(d / "llama.gguf", SPECS["llama"])
    g = open_gguf(d / "llama.gguf")
    yield d, g, build_model(g, precise=True)
    g.close()


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_tiny_llama_matches_transformers(tiny_llama, pooling):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    d, g, model = tiny_llama
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        d, gguf_file="llama.gguf", dtype=torch.float32, attn_implementation="eager"
    ).eval()
    # A budget of 16 tokens: the short inputs share forwards, the 40-token one runs in chunks.
    emb = Embedder(model, None, g.metadata, max_tokens=128, token_budget=16)
    seqs = [_ids(n, seed) for seed, n in enumerate([5, 40, 7, 3, 9])]
    assert len(emb.groups(seqs)) >= 3
    outs = emb.job(seqs, pooling, True).run()
    for s, out in zip(seqs, outs, strict=True):
        with torch.no_grad():
            h = hf.model(torch.tensor([s])).last_hidden_state[0]
        v = h[-1] if pooling == "last" else h.mean(0)
        torch.testing.assert_close(out.embedding, F.normalize(v, dim=0), atol=1e-4, rtol=1e-4)
        assert out.prompt_tokens == len(s)


def test_decoder_default_pooling_is_last(tiny_llama):
    _, g, model = tiny_llama
    emb = Embedder(model, None, g.metadata, max_tokens=128)
    seqs = [_ids(12, 7)]
    assert emb.pooling(None) == "last"
    default = emb.job(seqs, None, True).run()[0].embedding
    assert torch.equal(default, emb.job(seqs, "last", True).run()[0].embedding)
    assert not torch.allclose(default, emb.job(seqs, "mean", True).run()[0].embedding)


@torch.inference_mode()
def _plain_hidden(model, ids: list[int]) -> torch.Tensor:
    """One sequence, one forward, its own fresh cache: the model's plain prefill."""
    n = len(ids)
    layers, kv_heads, head_dim = model.kv_shape()
    kv = PagedKVCache(layers, -(-n // 16), 16, kv_heads, head_dim, dtype="f32")
    return model(torch.tensor(ids), torch.arange(n), BatchMeta.contiguous(n, n, 16), kv)


@pytest.fixture(scope="module")
def smol(smollm2_path):
    """One SmolLM2 engine for the module (loading is the slow part on a busy 2-core machine)."""
    engine = LLMEngine(str(smollm2_path), EngineArgs())
    yield engine
    engine.close()


# The default CPU kernels round activations to bf16 for small batches and pick kernels by row
# count; the embedding forward batches the three texts while the recomputation runs each alone,
# so the two agree to that rounding, not bit for bit (entries of a unit vector are ~0.04).
TOL = 2e-3


@pytest.mark.slow
def test_smollm2_matches_plain_torch(smol):
    for pooling in ("last", "mean"):
        outs = smol.embed(TEXTS, pooling=pooling)
        for text, out in zip(TEXTS, outs, strict=True):
            ids = smol.tokenize(text)
            h = _plain_hidden(smol.model, ids)
            v = F.normalize((h[-1] if pooling == "last" else h.mean(0)).float(), dim=0)
            assert out.embedding.shape == (smol.embedding_dim,)
            torch.testing.assert_close(out.embedding, v, atol=TOL, rtol=0)
            assert out.prompt_tokens == len(ids)
    raw = smol.embed(TEXTS[:1], normalize=False)[0].embedding
    want = _plain_hidden(smol.model, smol.tokenize(TEXTS[0]))[-1].float()
    assert float(want.norm()) > 2.0  # unnormalised: the raw hidden state, not a unit vector
    torch.testing.assert_close(raw, want, atol=TOL * float(want.norm()), rtol=0)


@pytest.mark.slow
def test_embedding_during_generation_leaves_it_unchanged(smol):
    prompt = "Once upon a time, in a small village by the mountains,"
    params = greedy(32)
    want_vectors = [smol.embed([t])[0].embedding for t in TEXTS]  # synchronous, before the thread
    eng = AsyncEngine(smol)

    async def generate(log: list[int]) -> list[int]:
        ids = []
        async for out in eng.generate(prompt, params):
            ids += out.outputs[0].token_ids
            log.append(len(ids))
        return ids

    async def main():
        alone = await generate([])
        log: list[int] = []
        gen = asyncio.create_task(generate(log))
        while not log:  # the generation is under way
            await asyncio.sleep(0.01)
        embedded = await asyncio.gather(*(eng.embed([t]) for t in TEXTS))
        seen_before_embeddings = log[-1]
        return alone, await gen, embedded, seen_before_embeddings

    try:
        alone, during, embedded, seen = asyncio.run(main())
        free = eng.engine.kv_manager.num_free_blocks
        total = eng.engine.kv_plan.num_blocks
    finally:
        eng.shutdown()
    assert len(alone) == 32 and during == alone
    assert seen < 32  # the embeddings came back while the generation was still running
    for got, want in zip(embedded, want_vectors, strict=True):
        torch.testing.assert_close(got[0].embedding, want, atol=1e-6, rtol=0)
    assert free == total
