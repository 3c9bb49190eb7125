"""Every error the server answers, in OpenAI's body: {"error": {message, type, param, code}};
on the Anthropic routes (/v1/messages...) in Anthropic's: {"type": "error", "error": {type,
message}}, the field named in the message.

Invariant: bad input is 400 with `param` naming the field (an InputError carries it, so no
message is parsed), a bad key 401, a full queue or a dead engine 503, anything unexpected 500
without its details; no handler lets a FastAPI or Starlette error body through.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvmemo.engine import EngineDeadError, QueueFullError

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error the server raises itself, with the status and OpenAI fields to answer with."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str,
        *,
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, dict[str, str | None]]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(
    status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
    request: Request | None = None,
) -> JSONResponse:
    if request is not None and request.url.path.startswith(ANTHROPIC_PREFIX):
        return JSONResponse(anthropic_error_body(status, message, type_, param), status_code=status)
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


ANTHROPIC_PREFIX = "/v1/messages"
# OpenAI-style types kvmemo raises -> Anthropic's (the others share a name)
_ANTHROPIC_TYPES = {"server_overloaded": "overloaded_error", "server_error": "api_error",
                    "conflict_error": "invalid_request_error"}


def anthropic_error_body(status: int, message: str, type_: str,
                         param: str | None = None) -> dict[str, object]:
    kind = _ANTHROPIC_TYPES.get(type_, type_)
    if status == 404:
        kind = "not_found_error"
    if param and param not in message:
        message = f"{param}: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def add_error_handlers(app: FastAPI) -> None:
    """Register the handler of every error a route can raise."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e.status, e.message, e.type, e.param, e.code, request=request)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = loc[0] if loc else None  # the top-level field, as OpenAI reports it
        if first.get("type") == "json_invalid":
            message, param = "request body is not valid JSON", None
        elif not loc and first.get("type") in ("model_attributes_type", "dict_type"):
            message = "request body must be a JSON object (send Content-Type: application/json)"
        elif param == "prompt":
            message = "prompt must be a non-empty string or a list of token ids"
        else:
            message = f"{'.'.join(loc)}: {first.get('msg')}" if loc else str(first.get("msg"))
        return error_response(400, message, "invalid_request_error", param, request=request)

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, e: ValueError):
        # kvmemo.errors.InputError (sampling params, prompts, messages, lengths, unsupported
        # fields) names its field; any other ValueError has none.
        return error_response(400, str(e), "invalid_request_error", getattr(e, "param", None),
                              request=request)

    @app.exception_handler(QueueFullError)
    async def _queue_full(request: Request, e: QueueFullError):
        return error_response(503, str(e), "server_overloaded", code="queue_full",
                              request=request)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, e: EngineDeadError):
        return error_response(503, str(e), "server_error", code="engine_unavailable",
                              request=request)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail), "invalid_request_error",
                              request=request)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        logger.exception("internal error")
        return error_response(500, f"internal error: {type(e).__name__}", "server_error",
                              request=request)
