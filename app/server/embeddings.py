"""POST /v1/embeddings in OpenAI's shape, for embedding GGUFs (BERT) and chat models alike.

`input` is a string, a list of strings, a list of token ids or a list of such lists. Vectors are
the model's pooled final hidden states (its own pooling unless `pooling` asks for another),
L2-normalised unless `normalize` is false; `encoding_format: base64` sends little-endian float32
bytes as the `openai` client expects. `dimensions` must equal the model's (no Matryoshka cutting).
An input longer than the model takes is a 400 unless `truncate_prompt_tokens` (vLLM's name; -1:
the model's limit) asks to cut it; cutting keeps the start and the trailing [SEP]/EOS.
"""

import asyncio
import base64
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, StrictBool, StrictInt, StrictStr

from localllm.app.server.common import resolve_model
from localllm.app.server.errors import APIError

router = APIRouter()

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request


class EmbeddingRequest(BaseModel):
    model: str | None = None
    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: str | None = None
    truncate_prompt_tokens: StrictInt | None = Field(default=None, ge=-1)
    normalize: StrictBool = True
    pooling: Literal["mean", "cls", "last"] | None = None

    def inputs(self) -> list[str | list[int]]:
        x = self.input
        if isinstance(x, str):
            return [x]
        if not x:
            raise APIError(400, "input must not be empty", param="input")
        if all(isinstance(t, int) for t in x):
            return [list(x)]
        if len(x) > MAX_INPUTS:
            raise APIError(400, f"at most {MAX_INPUTS} inputs per request", param="input")
        return list(x)


def _encode(v, fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(v.numpy().astype("<f4").tobytes()).decode("ascii")
    return v.tolist()


@router.post("/v1/embeddings")
async def create_embeddings(body: EmbeddingRequest, request: Request) -> JSONResponse:
    model, engine = await resolve_model(request, body.model)
    inputs = body.inputs()
    dim = engine.embedding_dim
    if body.dimensions is not None and body.dimensions != dim:
        raise APIError(
            400,
            f"this model makes {dim}-dimensional embeddings; dimensions={body.dimensions} is "
            "not supported",
            param="dimensions",
        )
    timeout = getattr(request.state, "timeout", request.app.state.settings.request_timeout)
    work = engine.embed(inputs, body.pooling, body.normalize, truncate=body.truncate_prompt_tokens)
    try:
        outs = await asyncio.wait_for(work, timeout)
    except TimeoutError:
        raise APIError(408, f"the request ran past {timeout} s", code="timeout") from None
    data = [
        {"object": "embedding", "index": i, "embedding": _encode(o.embedding, body.encoding_format)}
        for i, o in enumerate(outs)
    ]
    used = sum(o.prompt_tokens for o in outs)
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "model": model,
            "usage": {"prompt_tokens": used, "total_tokens": used},
        }
    )
