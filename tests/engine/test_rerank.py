"""Cross-encoder reranking (rank pooling + the classification head) against transformers.

The fixture (tests/data/rerank, made by tests/tools/record_rerank_fixture.py) is a tiny
random-weight `BertForSequenceClassification` converted by llama.cpp's own converter, plus
transformers' fp32 tokenization and logits of eight query-document pairs. llama.cpp's converter
drops BERT's pooler, so its file scores `classifier(h[CLS])` (`logit_without_pooler`); the second
file keeps the pooler as `cls` and must give transformers' own logits. Both within 1e-5 (fp32 on
both sides). The pair layout ([CLS] query [SEP] document [SEP]) and token types (1 for the
document's segment) must equal transformers' pair encoding exactly.
"""

import asyncio
import json
from pathlib import Path

import pytest
import torch

from localllm.engine import AsyncEngine
from localllm.engine.config import EngineArgs
from localllm.engine.embedder import RankPair
from localllm.engine.llm_engine import LLMEngine
from localllm.engine.models.bert import RankHead

DATA = Path(__file__).resolve().parents[1] / "data" / "rerank"
FIXTURE = json.loads((DATA / "tiny-bert-reranker.json").read_text(encoding="utf-8"))
PAIRS = FIXTURE["pairs"]
TOL = 1e-5  # fp32 weights and compute on both sides


@pytest.fixture(scope="module")
def bare() -> LLMEngine:
    """llama.cpp's conversion as it comes: no pooler, head = cls.output."""
    engine = LLMEngine(str(DATA / "tiny-bert-reranker.gguf"), EngineArgs())
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def pooled() -> LLMEngine:
    """The same model with its pooler kept as `cls`: head = cls.output(tanh(cls(h[CLS])))."""
    engine = LLMEngine(str(DATA / "tiny-bert-reranker-pooler.gguf"), EngineArgs())
    yield engine
    engine.close()


def _pairs(rows=PAIRS) -> list[RankPair]:
    return [RankPair(r["query"], r["document"]) for r in rows]


def test_pair_layout_and_token_types_match_transformers(bare):
    seqs = bare.prepare_embedding(_pairs())
    for row, seq in zip(PAIRS, seqs, strict=True):
        assert seq == row["input_ids"], row["document"]
        assert bare.embedder.token_types(seq) == row["token_type_ids"], row["document"]


def test_scores_match_transformers(bare, pooled):
    assert bare.can_rank and pooled.can_rank
    for engine, key in ((bare, "logit_without_pooler"), (pooled, "logit")):
        outs = engine.embed(_pairs(), pooling="rank")
        for row, out in zip(PAIRS, outs, strict=True):
            assert out.embedding.shape == (1,)  # one label: the relevance logit
            assert abs(float(out.embedding[0]) - row[key]) < TOL, (key, row["document"])
            assert out.prompt_tokens == len(row["input_ids"])
    # the two heads really differ: the pooler is not a no-op on these weights
    gaps = [abs(r["logit"] - r["logit_without_pooler"]) for r in PAIRS]
    assert min(gaps) > 0.05


def test_batch_equals_one_by_one_and_ids_input(pooled):
    batch = pooled.embed(_pairs(), pooling="rank")
    for pair, row, b in zip(_pairs(), PAIRS, batch, strict=True):
        one = pooled.embed([pair], pooling="rank")[0]
        assert abs(float(one.embedding[0]) - float(b.embedding[0])) < TOL
        # a pre-tokenized pair scores the same: its segments come from the first [SEP]
        by_ids = pooled.embed([row["input_ids"]], pooling="rank")[0]
        assert abs(float(by_ids.embedding[0]) - row["logit"]) < TOL
    # rank scores are never L2-normalised (normalize only applies to embeddings)
    raw = pooled.embed(_pairs()[:1], pooling="rank", normalize=True)[0].embedding
    assert abs(float(raw[0]) - PAIRS[0]["logit"]) < TOL


def test_special_text_in_a_document_is_plain_text(pooled):
    """Query and document are tokenized without special parsing (as llama-server does): a
    literal "[SEP]" cannot end the query's segment or forge a pair."""
    (seq,) = pooled.prepare_embedding([RankPair("where [SEP] cat", "the [SEP] mat")])
    sep = pooled.tokenizer.eos_id
    assert seq[0] == pooled.tokenizer.bos_id and seq[-1] == sep
    assert seq.count(sep) == 2  # only the two the layout adds
    types = pooled.embedder.token_types(seq)
    assert types[: seq.index(sep) + 1] == [0] * (seq.index(sep) + 1)
    assert set(types[seq.index(sep) + 1 :]) == {1}


def test_truncation_cuts_the_document(pooled):
    limit = pooled.max_model_len  # 48 in the fixture
    long = RankPair("where does the cat sleep?", " ".join(["cat"] * 80))
    with pytest.raises(ValueError, match=f"more than the {limit}"):
        pooled.prepare_embedding([long])
    (seq,) = pooled.prepare_embedding([long], truncate=-1)
    query = pooled.prepare_embedding([RankPair(long.query, "x")])[0][:8]  # [CLS] q [SEP]
    assert len(seq) == limit and seq[:8] == query and seq[-1] == pooled.tokenizer.eos_id
    (cut,) = pooled.prepare_embedding([long], truncate=20)
    assert len(cut) == 20 and cut[-1] == pooled.tokenizer.eos_id
    with pytest.raises(ValueError, match="query"):  # no room left for any of the document
        pooled.prepare_embedding([long], truncate=8)
    assert pooled.embed([long], pooling="rank", truncate=-1)[0].prompt_tokens == limit


def test_rank_needs_a_head_and_a_reranker_makes_no_embeddings(pooled, tmp_path):
    with pytest.raises(ValueError, match="reranker"):
        pooled.embed(["the cat"])  # its pooling_type is rank: no default embedding
    vec = pooled.embed(["the cat"], pooling="cls")[0].embedding  # hidden states still work
    assert vec.shape == (16,)
    from tests.engine.bert_gguf import write_bert_gguf
    from tests.engine.test_bert import VOCAB, _config, _random_state

    cfg = _config().to_dict() | {"max_position_embeddings": 16}
    path = write_bert_gguf(tmp_path / "embedder.gguf", cfg, _random_state(len(VOCAB)), VOCAB)
    engine = LLMEngine(str(path), EngineArgs())
    try:
        assert not engine.can_rank
        with pytest.raises(ValueError, match="no classification head"):
            engine.embed([RankPair("cat", "dog")], pooling="rank")
    finally:
        engine.close()


@pytest.mark.parametrize(
    "tensors, match",
    [
        ({"cls.bias": torch.zeros(16)}, "cls.bias without cls.weight"),
        ({"cls.weight": torch.zeros(16, 8)}, r"cls.weight .* \(16, 8\)"),
        ({"cls.output.weight": torch.zeros(1, 8)}, r"cls.output.weight .* \(1, 8\)"),
        ({"cls.output.weight": torch.zeros(2, 16), "cls.output.bias": torch.zeros(3)}, "bias"),
    ],
)
def test_malformed_heads_are_refused(tensors, match):
    with pytest.raises(ValueError, match=match):
        RankHead.from_tensors(tensors, dim=16)


def test_head_is_llamacpp_graph():
    """cls (dense + tanh) then cls.output (dense), each optional, on the first token's state."""
    torch.manual_seed(0)
    w, b, wo, bo = torch.randn(16, 16), torch.randn(16), torch.randn(1, 16), torch.randn(1)
    x = torch.randn(3, 16)
    head = RankHead.from_tensors({"cls.weight": w, "cls.bias": b, "cls.output.weight": wo,
                                  "cls.output.bias": bo}, dim=16)  # fmt: skip
    torch.testing.assert_close(head(x), torch.tanh(x @ w.T + b) @ wo.T + bo)
    only_out = RankHead.from_tensors({"cls.output.weight": wo.reshape(16)}, dim=16)  # 1-D form
    torch.testing.assert_close(only_out(x), x @ wo.T)
    assert RankHead.from_tensors({}, dim=16) is None


def test_async_engine_ranks_on_the_engine_thread():
    eng = AsyncEngine.from_model(str(DATA / "tiny-bert-reranker-pooler.gguf"))
    try:

        async def main():
            return await asyncio.gather(
                *(eng.embed([p], pooling="rank", normalize=False) for p in _pairs())
            )

        outs = asyncio.run(main())
        for row, (out,) in zip(PAIRS, outs, strict=True):
            assert abs(float(out.embedding[0]) - row["logit"]) < TOL
    finally:
        eng.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_scores_on_the_gpu():
    """The head, the token types and the batch on the device give the same scores."""
    for name, key in (("tiny-bert-reranker", "logit_without_pooler"),
                      ("tiny-bert-reranker-pooler", "logit")):  # fmt: skip
        engine = LLMEngine(str(DATA / f"{name}.gguf"), EngineArgs(device="cuda"))
        try:
            outs = engine.embed(_pairs(), pooling="rank")
            for row, out in zip(PAIRS, outs, strict=True):
                assert out.embedding.device.type == "cpu"
                assert abs(float(out.embedding[0]) - row[key]) < 1e-4, (name, row["document"])
        finally:
            engine.close()
