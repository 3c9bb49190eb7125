"""/v1/chat/completions with image_url data-URL parts, in process over ASGI, on a tiny LLaVA:
the answer equals an offline engine's, a repeat is served from the prefix cache, bad images are 400.
"""

from __future__ import annotations

import asyncio
import base64

import pytest

pytest.importorskip("PIL")

from kvmemo import LLM, SamplingParams  # noqa: E402
from tests.multimodal.tiny_llava import picture, png_bytes  # noqa: E402


@pytest.fixture(scope="module")
def served(llava):
    from kvmemo.engine.async_engine import AsyncEngine
    from kvmemo.server.app import create_app

    engine = AsyncEngine(
        LLM(model=str(llava[0]), device="cpu", block_size=8, num_blocks=256).engine
    )
    # The reference: a separate offline engine (an engine is stepped by one thread only).
    offline = LLM(
        model=str(llava[0]), device="cpu", block_size=8, num_blocks=256, enable_prefix_caching=False
    )
    yield offline, create_app(engine, model_name="tiny-llava")
    engine.shutdown()


def _post(app, body):
    import httpx

    async def call():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/v1/chat/completions", json=body, timeout=60)

    return asyncio.run(call())


def _data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def _body(url: str) -> dict:
    return {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "What is in this picture?"},
                ],
            }
        ],
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
    }


def test_image_url_chat_request(served) -> None:
    llm, app = served
    image = picture(601)
    response = _post(app, _body(_data_url(image)))
    assert response.status_code == 200, response.text
    answer = response.json()
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": image},
                {"type": "text", "text": "What is in this picture?"},
            ],
        }
    ]
    offline = llm.chat(
        messages, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False
    )[0]
    assert answer["choices"][0]["message"]["content"] == offline.outputs[0].text
    assert answer["usage"]["prompt_tokens"] == len(offline.prompt_token_ids)
    again = _post(app, _body(_data_url(image))).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 16  # the image's blocks hit
    assert again["choices"][0]["message"]["content"] == answer["choices"][0]["message"]["content"]


@pytest.mark.parametrize(
    ("url", "match"),
    [
        (
            "data:image/png;base64," + base64.b64encode(b"definitely not a png").decode(),
            "cannot decode",
        ),
        ("data:image/png;base64,%%%", "invalid base64"),
        ("https://example.com/cat.png", "data: URL"),
        ("/etc/hostname", "data: URL"),
    ],
)
def test_bad_image_is_400(served, url, match) -> None:
    response = _post(served[1], _body(url))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert match in error["message"] and error["param"] == "messages"
