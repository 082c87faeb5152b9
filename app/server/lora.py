"""LoRA adapters over HTTP, in the shapes llama-server and vLLM clients know.

llama-server: `GET /lora-adapters` lists the loaded adapters (`[{"id", "path", "scale", ...}]`),
`POST /lora-adapters` with `[{"id": N, "scale": S}]` sets the global scales (an adapter left out
gets 0) that requests without their own `lora` field use; a request's `lora` field picks adapters
and scales for it alone (those it leaves out run at 0). vLLM: adapters given as
`--lora-modules NAME=PATH` are extra model names (listed by /v1/models with the base as
`parent`); a request whose `model` is NAME runs that adapter at scale 1.
"""

import dataclasses
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from localllm.app.server.errors import APIError

router = APIRouter()


class LoraEntry(BaseModel):
    """One `{"id": N, "scale": S}` of a request's `lora` list or of POST /lora-adapters."""

    id: int
    scale: float = 0.0  # llama-server's default for a missing scale


def pairs(entries: list[LoraEntry] | None) -> tuple[tuple[int, float], ...] | None:
    return None if entries is None else tuple((e.id, e.scale) for e in entries)


def loras_of(engine: Any):
    """The engine's `LoraSet`, or None (no adapters, or an engine not loaded)."""
    return getattr(getattr(engine, "engine", None), "loras", None)


def _default_loras(request: Request):
    r = request.app.state.router
    return loras_of(r.engine(r.default))


@router.get("/lora-adapters")
async def list_adapters(request: Request) -> JSONResponse:
    loras = _default_loras(request)
    return JSONResponse(loras.describe() if loras is not None else [])


@router.post("/lora-adapters")
async def set_scales(request: Request) -> JSONResponse:
    loras = _default_loras(request)
    if loras is None:
        raise APIError(400, "no LoRA adapters are loaded (serve --lora PATH)")
    body = await request.json()
    if not isinstance(body, list):
        raise APIError(400, 'the body must be a list of {"id": N, "scale": S}')
    try:
        entries = [LoraEntry.model_validate(e) for e in body]
        loras.set_scales(pairs(entries))
    except (ValidationError, ValueError) as e:
        raise APIError(400, f"bad LoRA list: {e}".splitlines()[0]) from None
    return JSONResponse({"success": True})


def route(model: str | None, entry_id: str, engine: Any) -> tuple[str, Any]:
    """(the id to report, the engine) for a request naming `model`: a served adapter's name
    gives that name and the engine with the adapter applied to requests that pick none."""
    loras = loras_of(engine)
    slot = loras.served().get(model) if loras is not None and model else None
    if slot is None:
        return entry_id, engine
    return model, _WithAdapter(engine, ((slot, 1.0),))


class _WithAdapter:
    """The engine as an endpoint sees it, its requests' `lora` defaulting to one adapter."""

    def __init__(self, engine: Any, lora: tuple[tuple[int, float], ...]):
        self._engine, self._lora = engine, lora

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def _params(self, params):
        from localllm.engine.sampling.params import SamplingParams

        params = params or SamplingParams()
        return params if params.lora is not None else dataclasses.replace(params, lora=self._lora)

    def generate(self, prompt, params=None, *args, **kw):
        return self._engine.generate(prompt, self._params(params), *args, **kw)

    def chat(self, messages, params=None, *args, **kw):
        return self._engine.chat(messages, self._params(params), *args, **kw)


def lora_cards(request: Request) -> list[dict]:
    """/v1/models entries of the served adapters of every loaded model (vLLM's shape)."""
    s, r = request.app.state.settings, request.app.state.router
    cards = []
    for entry in r.entries:
        loras = loras_of(r.engine(entry))
        for name in loras.served() if loras is not None else ():
            path = loras.adapters[loras.served()[name]].path
            cards.append({"id": name, "object": "model", "created": s.created,
                          "owned_by": s.owned_by, "root": path, "parent": entry.id,
                          "status": "loaded"})  # fmt: skip
    return cards
