"""GET /v1/models, /health, /version: what is served and whether it is up."""

from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

router = APIRouter()


def _version() -> str:
    try:
        return version("localllm")
    except PackageNotFoundError:
        return "unknown"


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    s, engine = request.app.state.settings, request.app.state.engine
    card = {
        "id": s.model_id,
        "object": "model",
        "created": s.created,
        "owned_by": s.owned_by,
        "root": s.model_id,
        "parent": None,
        "max_model_len": engine.max_model_len,
        "context_length": engine.max_model_len,
    }
    return JSONResponse({"object": "list", "data": [card]})


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    if not request.app.state.engine.alive:
        return JSONResponse({"status": "error", "message": "engine stopped"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/version")
async def get_version() -> JSONResponse:
    return JSONResponse({"version": _version()})
