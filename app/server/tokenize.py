"""POST /tokenize and /detokenize in llama-server's shapes, for the body's `model` (or the
default model)."""

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from localllm.app.server.common import resolve_model
from localllm.app.server.protocol import DetokenizeRequest, TokenizeRequest

router = APIRouter()


class ModelTokenizeRequest(TokenizeRequest):
    model: str | None = None  # which model's tokenizer (default: the first)


class ModelDetokenizeRequest(DetokenizeRequest):
    model: str | None = None


def _piece(raw: bytes) -> str | list[int]:
    """llama-server's rule: the text when the token is whole UTF-8, else its bytes."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


@router.post("/tokenize")
async def tokenize(body: ModelTokenizeRequest, request: Request) -> JSONResponse:
    _, engine = await resolve_model(request, body.model)
    tok = engine.tokenizer

    def work() -> list:
        ids = tok.encode(body.content, add_special=body.add_special, parse_special=True)
        if not body.with_pieces:
            return ids
        return [{"id": t, "piece": _piece(tok.decode_bytes([t]))} for t in ids]

    # Off the event loop: a body-sized text takes a second or more to tokenize.
    return JSONResponse({"tokens": await asyncio.to_thread(work)})


@router.post("/detokenize")
async def detokenize(body: ModelDetokenizeRequest, request: Request) -> JSONResponse:
    _, engine = await resolve_model(request, body.model)
    text = await asyncio.to_thread(engine.tokenizer.decode, body.tokens)
    return JSONResponse({"content": text})
