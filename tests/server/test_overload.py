"""A full waiting queue answers 503 in OpenAI's error format; the server stays healthy."""

from __future__ import annotations

import pytest

from tests.server.conftest import launch_server

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def server():
    # --max-waiting 0: every request would have to wait for admission, so every one is refused.
    with launch_server(
        "--num-blocks", "64", "--max-model-len", "256", "--max-waiting", "0"
    ) as running:
        yield running


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": True}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        ),
    ],
)
def test_full_queue_is_503(server, path, body):
    with server.http() as http:
        response = http.post(path, json=body)
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["code"] == "queue_full" and "overloaded" in error["message"]
        assert http.get("/health").status_code == 200
    assert server.metrics()[f"kvmemo_requests_total{{route={path},status=503}}"] >= 1


def test_openai_client_sees_503(server):
    import openai

    with pytest.raises(openai.APIStatusError) as info:
        server.openai().completions.create(prompt="hi", max_tokens=2, model=server.model_name())
    assert info.value.status_code == 503
