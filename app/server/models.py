"""GET /v1/models, /health, /version: what is served and whether it is up."""

from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from localllm.app.server.lora import lora_cards
from localllm.app.server.media_inputs import vision_of
from localllm.app.server.router import ModelEntry

router = APIRouter()


def _version() -> str:
    try:
        return version("localllm")
    except PackageNotFoundError:
        return "unknown"


def capabilities(entry: ModelEntry) -> list[str]:
    if not entry.generates:
        return ["rerank"] if entry.cross_encoder else ["embeddings", "rerank"]
    caps = ["completion", "chat", "embeddings", "rerank"]  # rerank: by embedding similarity
    return [*caps, "infill"] if entry.fim else caps


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    """Every servable model, loaded or not, with its context length and what it can do."""
    s, r = request.app.state.settings, request.app.state.router
    cards = []
    for entry in r.entries:
        engine = r.engine(entry)
        ctx = engine.max_model_len if engine is not None else entry.context_length
        cards.append(
            {
                "id": entry.id,
                "object": "model",
                "created": s.created,
                "owned_by": s.owned_by,
                "root": entry.id,
                "parent": None,
                "max_model_len": ctx,
                "context_length": ctx,
                "status": r.status(entry),
                "capabilities": capabilities(entry) + _media(vision_of(engine)),
            }
        )
    cards += lora_cards(request)  # vLLM's --lora-modules names
    return JSONResponse({"object": "list", "data": cards})


def _media(vision) -> list[str]:
    """ "vision" for a model served with a projector, "video" too when its family takes video."""
    if vision is None:
        return []
    return ["vision", "video"] if hasattr(vision.processor, "preprocess_video") else ["vision"]


@router.get("/health")
async def health(request: Request, model: str | None = None) -> JSONResponse:
    """Up when the (named or default) model's engine runs, or when it is simply not loaded."""
    r = request.app.state.router
    entry = r.find(model)
    engine = r.engine(entry)
    if engine is not None and not engine.alive:
        return JSONResponse({"status": "error", "message": "engine stopped"}, status_code=503)
    if model:
        return JSONResponse({"status": "ok", "model": entry.id, "model_status": r.status(entry)})
    return JSONResponse({"status": "ok"})


@router.get("/version")
async def get_version() -> JSONResponse:
    return JSONResponse({"version": _version()})
