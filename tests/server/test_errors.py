"""server/errors.py in process, without a model: every handled error becomes OpenAI's body with
the right status, and a 400's `param` comes from the exception, never from its message."""

from __future__ import annotations

import asyncio

import pytest

from kvmemo.engine import EngineDeadError, QueueFullError
from kvmemo.errors import InputError
from kvmemo.server.errors import APIError, add_error_handlers
from kvmemo.server.protocol import UnsupportedFieldError


def _app(error: Exception):
    from fastapi import FastAPI

    app = FastAPI()
    add_error_handlers(app)

    @app.post("/raise")
    async def _raise():
        raise error

    return app


def _post(app, path: str = "/raise"):
    import httpx

    async def call():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path)

    return asyncio.run(call())


@pytest.mark.parametrize(
    ("error", "status", "type_", "param", "code"),
    [
        # param is the exception's: a message naming another field does not change it
        (
            InputError("top_p", "temperature and top_p clash"),
            400,
            "invalid_request_error",
            "top_p",
            None,
        ),
        # a plain ValueError has no param, even when its message starts with a field name
        (ValueError("temperature must be >= 0"), 400, "invalid_request_error", None, None),
        (
            UnsupportedFieldError("echo", "echo is not supported"),
            400,
            "invalid_request_error",
            "echo",
            None,
        ),
        (
            APIError(409, "busy", "conflict_error", code="cache_in_use"),
            409,
            "conflict_error",
            None,
            "cache_in_use",
        ),
        (QueueFullError("full"), 503, "server_overloaded", None, "queue_full"),
        (EngineDeadError("dead"), 503, "server_error", None, "engine_unavailable"),
        (RuntimeError("secret detail"), 500, "server_error", None, None),
    ],
)
def test_errors_become_openai_bodies(error, status, type_, param, code):
    response = _post(_app(error))
    assert response.status_code == status
    body = response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert (body["type"], body["param"], body["code"]) == (type_, param, code)
    if status == 500:
        assert body["message"] == "internal error: RuntimeError"  # no details leak
    else:
        assert body["message"] == str(error)


def test_unsupported_field_error_is_an_input_error():
    assert issubclass(UnsupportedFieldError, InputError)
    assert issubclass(UnsupportedFieldError, ValueError)


def test_unknown_route_is_openai_shaped():
    response = _post(_app(ValueError()), "/nope")
    assert response.status_code == 404
    assert response.json() == {
        "error": {
            "message": "Not Found",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
    }
