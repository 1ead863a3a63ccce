"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, for every failure the server
answers: bad parameters (400, naming the field), a missing or wrong API key (401), an unknown model or route
(404), a prompt over the context length (400 `context_length_exceeded`), a server that is shutting down or whose
engine died (503)."""

from __future__ import annotations

import json
import logging
from typing import Any

logger = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status_code: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status_code, self.message, self.param, self.code = status_code, message, param, code
        self.type = type or ("invalid_request_error" if status_code < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unavailable(message: str) -> APIError:
    return APIError(503, message, code="service_unavailable")


def from_validation_errors(errors: list[dict[str, Any]]) -> APIError:
    """The first pydantic error, naming its field (`stream_options.include_usage`, `messages`): OpenAI names one."""
    error = errors[0]
    loc = [str(part) for part in error.get("loc", ()) if part != "body"]
    # Union members show up in the location as type names (`prompt.list[int]`): the field is what comes before.
    fields = [part for part in loc if not part.isdigit() and "[" not in part and part not in _TYPE_NAMES]
    param = ".".join(fields) or None
    if error.get("type") == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param)
    if error.get("type") == "missing":
        return bad_request(f"Missing required parameter: {param}", param)
    value = error.get("input")
    shown = "" if value is None and error.get("type") != "none_required" else f" (got {_short(value)})"
    return bad_request(f"Invalid value for {param}: {error.get('msg', 'invalid')}{shown}", param)


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "function-after", "union"})


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def install_handlers(app: Any) -> None:
    """Answer APIError, FastAPI's validation errors, HTTP errors (404 routes, 405 methods) and anything unexpected
    in OpenAI's shape."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    async def api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status_code)

    async def validation_error(request, exc: RequestValidationError):
        errors = list(exc.errors())
        if any(e.get("type") == "json_invalid" for e in errors):
            return await api_error(request, bad_request("The request body is not valid JSON"))
        return await api_error(request, from_validation_errors(errors))

    async def http_error(request, exc: HTTPException):
        error = APIError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)
        return JSONResponse(error.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    async def unexpected(request, exc: Exception):
        logger.exception("unexpected error answering %s", request.url.path)
        error = APIError(500, f"internal server error: {type(exc).__name__}: {exc}")
        return JSONResponse(error.body(), status_code=500)

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
