"""Every model family on tiny random GGUFs: logits vs transformers, KV cache, batching, windows.

The reference is transformers loading the very same GGUF file (it dequantizes with gguf-py), with
the few hyper-parameters its GGUF reader drops passed explicitly (see `hf_overrides`). Both sides
compute in float32, so logits of std ~1 agree to ~1e-5; we assert LOGIT_TOL.
"""

import itertools
from types import SimpleNamespace

import pytest
import torch

from localllm.engine.core.batch import BatchMeta
from localllm.engine.generator import Generator
from localllm.engine.gguf import open_gguf
from localllm.engine.loader import ModelLoadError, build_model
from localllm.engine.runtime.kv_cache import PagedKVCache
from localllm.engine.sampling.params import SamplingParams
from tests.engine.tiny_models import SPECS, TinySpec, longrope_factors, write_tiny_gguf

FAMILIES = list(SPECS)
LOGIT_TOL = 1e-4  # fp32 vs fp32, different summation orders (measured max ~1e-5)
FAST_TOL = 0.15  # default kernels round weights/activations to bf16 (see the test)
CACHE_TOL = 2e-5  # same engine, decode vs full recompute: only matmul shapes differ
SEQ_LEN = 40  # longer than gemma3's window (8) and phi3_longrope's original context (32)


def hf_overrides(spec: TinySpec) -> dict:
    """Config values transformers' GGUF reader does not take from the file."""
    kw: dict = {"attn_implementation": "eager"}
    if spec.arch == "qwen3":
        kw["head_dim"] = spec.head_dim  # attention.key_length is not mapped for qwen3
    if spec.arch == "gemma3":
        p = spec.swa_pattern
        kw["layer_types"] = [
            "full_attention" if i % p == p - 1 else "sliding_attention"
            for i in range(spec.n_layers)
        ]
        # llama.cpp scales queries by head_dim^-0.5 (all sizes but 27B); in HF terms that is
        # query_pre_attn_scalar = head_dim, which is what Gemma 3 270M/1B/4B/12B configs say.
        kw["query_pre_attn_scalar"] = spec.head_dim
        kw["final_logit_softcapping"] = spec.softcap or None
    if spec.arch == "phi3":
        rope = {
            "rope_type": "default",
            "rope_theta": spec.rope_base,
            "partial_rotary_factor": (spec.rope_dims or spec.head_dim) / spec.head_dim,
        }
        if spec.longrope_orig:
            long, short = longrope_factors(spec)
            rope.update(
                rope_type="longrope",
                long_factor=long.tolist(),
                short_factor=short.tolist(),
                original_max_position_embeddings=spec.longrope_orig,
            )
            kw["original_max_position_embeddings"] = spec.longrope_orig
        kw["rope_parameters"] = rope
    return kw


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_models")
    for key, spec in SPECS.items():
        write_tiny_gguf(d / f"{key}.gguf", spec)
        write_tiny_gguf(d / f"{key}_q.gguf", spec, quant=True)
    return d


@pytest.fixture(scope="module")
def reference(gguf_dir):
    """reference(file_stem) -> transformers model on that GGUF (one import, models cached)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    cache = {}

    def load(stem: str):
        if stem not in cache:
            spec = SPECS[stem.removesuffix("_q")]
            cache[stem] = transformers.AutoModelForCausalLM.from_pretrained(
                gguf_dir, gguf_file=f"{stem}.gguf", dtype=torch.float32, **hf_overrides(spec)
            ).eval()
        return cache[stem]

    return load


@pytest.fixture(scope="module")
def ours(gguf_dir):
    """ours(file_stem) -> (GGUFModel, our model) with float32 matmuls (cached per module)."""
    cache = {}

    def load(stem: str):
        if stem not in cache:
            g = open_gguf(gguf_dir / f"{stem}.gguf")
            cache[stem] = (g, build_model(g, precise=True))
        return cache[stem]

    yield load
    for g, _ in cache.values():
        g.close()


def tokens(n: int, seed: int = 1, vocab: int = 256) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


BLOCK = 4  # small blocks: a 40-token sequence spans many, some of them partly filled


def new_cache(model, num_blocks: int, dtype: str = "f32") -> PagedKVCache:
    layers, kv_heads, head_dim = model.kv_shape()
    return PagedKVCache(layers, num_blocks, BLOCK, kv_heads, head_dim, dtype=dtype)


def one_seq(num_new: int, seq_len: int) -> BatchMeta:
    return BatchMeta.contiguous(num_new, seq_len, BLOCK)


@torch.inference_mode()
def full_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits of every position from one forward over the whole sequence."""
    n = len(ids)
    h = model(torch.tensor(ids), torch.arange(n), one_seq(n, n), new_cache(model, -(-n // BLOCK)))
    return model.logits(h)


@torch.inference_mode()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("quant", [False, True], ids=["f32", "q8_0+q4_0"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family, quant, ours, reference):
    stem = f"{family}_q" if quant else family
    ids = tokens(SEQ_LEN)
    got = full_logits(ours(stem)[1], ids)
    want = hf_logits(reference(stem), ids)
    assert got.shape == want.shape == (SEQ_LEN, SPECS[family].vocab)
    assert want.std() > 0.3  # logits carry signal: a broken model cannot match by accident
    err = (got - want).abs().max().item()
    assert err < LOGIT_TOL, f"{stem}: max |ours - transformers| = {err:.2e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_default_kernels_stay_close_to_transformers(family, gguf_dir, reference):
    """The default (fast, keep-quant) kernels on Q8_0/Q4_0 weights: bf16 rounding inside the
    kernels moves logits of std ~1 by a few 1e-2 (measured max 5.5e-2), so FAST_TOL is loose."""
    stem, ids = f"{family}_q", tokens(SEQ_LEN)
    with open_gguf(gguf_dir / f"{stem}.gguf") as g:
        got = full_logits(build_model(g), ids)
    err = (got - hf_logits(reference(stem), ids)).abs().max().item()
    assert err < FAST_TOL, f"{stem}: default kernels vs transformers = {err:.2e}"


@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_cached_decode_matches_full_recompute(family, ours):
    """Chunked prefill (13 + 7 tokens) then one token at a time == one forward over everything."""
    model = ours(family)[1]
    ids = tokens(SEQ_LEN, seed=2)
    want = full_logits(model, ids)
    kv = new_cache(model, SEQ_LEN // BLOCK)
    bounds = [0, 13, 20, *range(21, SEQ_LEN + 1)]
    for s, e in itertools.pairwise(bounds):
        h = model(torch.tensor(ids[s:e]), torch.arange(s, e), one_seq(e - s, e), kv)
        err = (model.logits(h) - want[s:e]).abs().max().item()
        assert err < CACHE_TOL, f"{family}: tokens {s}..{e}: {err:.2e}"


@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_batch_of_two_matches_each_alone(family, ours):
    """Two sequences of different lengths in one flat forward, then a mixed prefill+decode step,
    over interleaved, out-of-order block tables."""
    model = ours(family)[1]
    a, b = tokens(11, seed=3), tokens(23, seed=4)
    kv = new_cache(model, 12)
    table_a, table_b = (7, 2, 10), (5, 0, 9, 3, 11, 1)  # 3 x 4 >= 12 and 6 x 4 >= 23 tokens
    # step 1: all of `a`, the first 17 of `b`
    ids = torch.tensor(a + b[:17])
    pos = torch.cat((torch.arange(11), torch.arange(17)))
    h = model(ids, pos, BatchMeta.from_tables((11, 17), (11, 17), (table_a, table_b), BLOCK), kv)
    out = model.logits(h)
    want_a, want_b = full_logits(model, a), full_logits(model, b)
    assert (out[:11] - want_a).abs().max() < CACHE_TOL
    assert (out[11:] - want_b[:17]).abs().max() < CACHE_TOL
    # step 2: `b` appends 6 tokens while `a` decodes one more (its 12th: b[0] reused as input)
    a2 = [*a, b[0]]
    ids = torch.tensor([a2[11], *b[17:]])
    pos = torch.tensor([11, *range(17, 23)])
    h = model(ids, pos, BatchMeta.from_tables((1, 6), (12, 23), (table_a, table_b), BLOCK), kv)
    out = model.logits(h)
    assert (out[0] - full_logits(model, a2)[11]).abs().max() < CACHE_TOL
    assert (out[1:] - want_b[17:]).abs().max() < CACHE_TOL


@pytest.mark.parametrize("family", [f for f in FAMILIES if SPECS[f].window])
@torch.inference_mode()
def test_sliding_window_decode_matches_reference(family, ours, reference):
    """Decoding far past the window matches transformers, and the window does change the result."""
    spec, model = SPECS[family], ours(family)[1]
    ids = tokens(4 * spec.window, seed=5)
    want = hf_logits(reference(family), ids)
    kv = new_cache(model, -(-len(ids) // BLOCK))
    rows = []
    for t, token in enumerate(ids):
        h = model(torch.tensor([token]), torch.tensor([t]), one_seq(1, t + 1), kv)
        rows.append(model.logits(h))
    err = (torch.cat(rows) - want).abs().max().item()
    assert err < LOGIT_TOL, f"{family}: decode past the window: {err:.2e}"
    local = [blk for blk in model.blk if blk.local]
    assert local and not all(blk.local for blk in model.blk)  # both kinds of layer present
    try:
        for blk in local:
            blk.local = False
        unwindowed = full_logits(model, ids)
    finally:
        for blk in local:
            blk.local = True
    assert (unwindowed - want).abs().max() > 100 * LOGIT_TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_is_deterministic_and_argmax(family, ours):
    g, model = ours(family)
    gen = Generator(g, model, SimpleNamespace(eog_ids=frozenset()), load_seconds=0.0)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt = tokens(6, seed=6)
    first = list(gen.stream(prompt, params))
    assert len(first) == 12
    assert list(gen.stream(prompt, params)) == first
    # each generated token is the argmax of a full teacher-forced recompute at its position
    scores = gen.score(prompt + first)
    assert scores[len(prompt) - 1 : -1].argmax(-1).tolist() == first


@pytest.mark.parametrize(
    ("family", "missing"),
    [
        ("gemma3", "blk.1.post_ffw_norm.weight"),
        ("qwen3", "blk.0.attn_k_norm.weight"),
        ("phi3", "blk.1.attn_qkv.weight"),
        ("qwen2", "output_norm.weight"),
    ],
)
def test_missing_tensor_is_a_load_error(family, missing, tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf", SPECS[family], drop=(missing,))
    with open_gguf(path) as g, pytest.raises(ModelLoadError, match=missing.rsplit(".", 1)[0]):
        build_model(g)


# About twice the max measured over the families (f16 3.3e-3, bf16 2.4e-2, q8_0 7.1e-2, fp8 0.33):
# random tiny models have no outlier structure, so this only bounds the plumbing, not quality.
KV_TOL = {"f16": 0.01, "bf16": 0.06, "q8_0": 0.15, "fp8": 0.7}


@pytest.mark.parametrize("dtype", list(KV_TOL))
@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_low_precision_kv_stays_close(family, dtype, ours):
    """A 13-token prefill then decode with KV stored as `dtype`: logits near the f32-KV ones."""
    model = ours(family)[1]
    ids = tokens(SEQ_LEN, seed=7)
    want = full_logits(model, ids)
    kv = new_cache(model, SEQ_LEN // BLOCK, dtype)
    bounds = [0, 13, *range(14, SEQ_LEN + 1)]
    errs = []
    for s, e in itertools.pairwise(bounds):
        h = model(torch.tensor(ids[s:e]), torch.arange(s, e), one_seq(e - s, e), kv)
        errs.append((model.logits(h) - want[s:e]).abs().max().item())
    assert 0 < max(errs) < KV_TOL[dtype], f"{family} {dtype}: {max(errs):.2e}"
