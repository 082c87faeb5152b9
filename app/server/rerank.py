"""POST /v1/rerank, /rerank and /v2/rerank: documents ordered by relevance to a query, in the
Cohere/Jina shape that llama-server and vLLM serve.

Request `{model?, query, documents: [str | {text}], top_n?, return_documents?,
truncate_prompt_tokens?, use_activation?}`; response `{id, model, results: [{index,
relevance_score, document?: {text}}], usage: {prompt_tokens, total_tokens}}`, most relevant first.

How a model scores: a cross-encoder (a GGUF with a classification head, such as bge-reranker or
an ms-marco cross-encoder) reads each `[CLS] query [SEP] document [SEP]` pair and its head's
logit is the score, raw as llama-server reports it (`use_activation: true`: its sigmoid, vLLM's
default). Any other model embeds the query and the documents and scores by cosine similarity.
`top_n` (absent or 0: all) keeps the best; `return_documents` (default false) echoes each text.
A pair longer than the model's context is a 400 unless `truncate_prompt_tokens` (-1: the
context) asks to cut the document. The tokenizing and scoring run on the engine's embedding
path (a worker thread, then the engine thread), never on the event loop.
"""

import asyncio
import math
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, StrictBool, StrictInt, StrictStr

from localllm.app.server.common import check_prompt_chars, resolve_model
from localllm.app.server.errors import APIError
from localllm.engine.embedder import RankPair

router = APIRouter()

MAX_DOCUMENTS = 1000  # per request (Cohere's limit); more is a 400


class RerankDocument(BaseModel):
    text: StrictStr


class RerankRequest(BaseModel):
    model: str | None = None
    query: StrictStr
    documents: list[StrictStr | RerankDocument]
    top_n: StrictInt | None = Field(default=None, ge=0)  # None or 0: every document
    return_documents: StrictBool = False
    truncate_prompt_tokens: StrictInt | None = Field(default=None, ge=-1)
    use_activation: StrictBool | None = None  # sigmoid of a cross-encoder's logit

    def texts(self) -> list[str]:
        if not self.query:
            raise APIError(400, "query must not be empty", param="query")
        if not self.documents:
            raise APIError(400, "documents must not be empty", param="documents")
        if len(self.documents) > MAX_DOCUMENTS:
            raise APIError(400, f"at most {MAX_DOCUMENTS} documents per request", param="documents")
        texts = [d if isinstance(d, str) else d.text for d in self.documents]
        for i, t in enumerate(texts):
            if not t:
                raise APIError(400, f"document {i} is empty", param=f"documents.{i}")
        return texts


async def _cross_encoder(engine, body: RerankRequest, texts: list[str]) -> tuple[list, int]:
    pairs = [RankPair(body.query, t) for t in texts]
    outs = await engine.embed(pairs, "rank", False, truncate=body.truncate_prompt_tokens)
    scores = [float(o.embedding[0]) for o in outs]  # the first label, as llama-server reads it
    if body.use_activation:
        scores = [1.0 / (1.0 + math.exp(-s)) if s > -700 else 0.0 for s in scores]
    return scores, sum(o.prompt_tokens for o in outs)


async def _similarity(engine, body: RerankRequest, texts: list[str]) -> tuple[list, int]:
    outs = await engine.embed([body.query, *texts], truncate=body.truncate_prompt_tokens)
    query = outs[0].embedding
    scores = [float(query @ o.embedding) for o in outs[1:]]  # unit vectors: the cosine
    return scores, sum(o.prompt_tokens for o in outs)


@router.post("/v1/rerank")
@router.post("/rerank")
@router.post("/v2/rerank")
async def rerank(body: RerankRequest, request: Request) -> JSONResponse:
    texts = body.texts()
    # the prompt-size limit counts the query and every document, before any tokenizing
    check_prompt_chars(request.app.state.settings, {"input": [body.query, *texts]})
    model, engine = await resolve_model(request, body.model)
    core = getattr(engine, "engine", None)  # the AsyncEngine's LLMEngine
    cross = bool(getattr(core, "can_rank", False))
    timeout = getattr(request.state, "timeout", request.app.state.settings.request_timeout)
    work = (_cross_encoder if cross else _similarity)(engine, body, texts)
    try:
        scores, used = await asyncio.wait_for(work, timeout)
    except TimeoutError:
        raise APIError(408, f"the request ran past {timeout} s", code="timeout") from None
    order = sorted(range(len(texts)), key=lambda i: -scores[i])
    if body.top_n:
        order = order[: body.top_n]
    results = []
    for i in order:
        item = {"index": i, "relevance_score": scores[i]}
        if body.return_documents:
            item["document"] = {"text": texts[i]}
        results.append(item)
    return JSONResponse(
        {
            "id": f"rerank-{uuid.uuid4().hex}",
            "object": "list",
            "model": model,
            "results": results,
            "usage": {"prompt_tokens": used, "total_tokens": used},
        }
    )
