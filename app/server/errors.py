"""One mapping from failures to OpenAI-shaped errors: `{"error": {message, type, param, code}}`.

Validation problems (pydantic, malformed JSON, engine `ValueError`s) are 400, never FastAPI's 422,
because OpenAI clients only know OpenAI's shape.
"""

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from localllm.engine.async_engine import EngineDeadError

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error the client should see as is."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def to_api_error(exc: BaseException) -> APIError:
    """What an exception means to the client (also used for errors inside an SSE stream)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_dead")
    if isinstance(exc, ValueError):
        return APIError(400, str(exc) or type(exc).__name__)
    if isinstance(exc, TimeoutError):
        return APIError(408, "the request timed out", code="timeout")
    log.error("internal error", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('msg', '')}", None
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    return (f"{param}: {msg}" if param else msg), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    async def _mapped(_: Request, exc: Exception) -> JSONResponse:
        e = to_api_error(exc)
        return error_response(e.status, e.message, e.param, e.code)

    # Known kinds go through ExceptionMiddleware; Exception itself reaches ServerErrorMiddleware,
    # which answers with this body too (and logs the traceback).
    for kind in (APIError, ValueError, EngineDeadError, TimeoutError, Exception):
        app.add_exception_handler(kind, _mapped)
