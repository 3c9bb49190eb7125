"""Streaming a 4,000-token reply through the server's own code (the app in process, over ASGI, on
a tiny random Llama): the server receives only what is new for each token (delta outputs), so
the last 100 tokens cost what the first 100 did, counted in characters and ids handed over and
in token ids detokenized; and the streamed pieces add up to the non-streamed reply."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from kvmemo.config import EngineConfig
from kvmemo.engine import AsyncEngine, Engine
from kvmemo.engine.detokenizer import IncrementalDetokenizer
from kvmemo.server.app import create_app
from kvmemo.server.job import Job
from tests.gpu.tiny_llama import save_tiny_llama

NUM_TOKENS = 4000
WINDOW = 100
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119]  # ids under the tiny model's 512
LETTERS = list(range(81, 100))  # "a".."s": one character each, so every token adds the same


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_llama_stream")
    save_tiny_llama(directory, vocab_size=512, hidden_size=64, intermediate_size=96,
                    num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=8192)
    engine = AsyncEngine(Engine(EngineConfig(
        model=str(directory), device="cpu", dtype="float32", max_model_len=NUM_TOKENS + 64,
        num_blocks=(NUM_TOKENS + 64) // 16 * 2 + 8)))
    yield create_app(engine, model_name="tiny")
    engine.shutdown()


def post(app, body: dict) -> list[str]:
    import httpx

    async def run() -> list[str]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=600) as c:
            async with c.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200, await response.aread()
                return [line async for line in response.aiter_lines() if line]

    return asyncio.run(run())


def test_a_4000_token_stream_costs_the_same_per_token_at_the_end(app, monkeypatch) -> None:
    handed: list[int] = []  # per engine output the server receives: characters + ids + entries
    seconds: list[float] = []
    update = Job.update

    def counting_update(job, item):
        completion = item.output.outputs[0]
        handed.append(len(completion.text) + len(completion.token_ids)
                      + len(completion.logprobs or ()))
        start = time.perf_counter()
        try:
            return update(job, item)
        finally:
            seconds.append(time.perf_counter() - start)

    decoded: list[int] = []  # token ids detokenized per token
    add_token = IncrementalDetokenizer.add_token

    def counting_add_token(detokenizer, *args, **kwargs):
        before = detokenizer.num_decoded_tokens
        stopped = add_token(detokenizer, *args, **kwargs)
        decoded.append(detokenizer.num_decoded_tokens - before)
        return stopped

    monkeypatch.setattr(Job, "update", counting_update)
    monkeypatch.setattr(IncrementalDetokenizer, "add_token", counting_add_token)
    body = {"prompt": PROMPT, "max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True,
            "logprobs": 1, "allowed_token_ids": LETTERS}
    lines = post(app, {**body, "stream": True})
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    streamed = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    tokens = [t for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
              for t in c["choices"][0]["logprobs"]["tokens"]]
    assert len(tokens) == NUM_TOKENS and len(decoded) == NUM_TOKENS
    assert len(handed) == NUM_TOKENS and len(streamed) == NUM_TOKENS  # one letter per token

    first, last = sum(handed[:WINDOW]), sum(handed[-WINDOW:])
    print(f"handed to the server: first {WINDOW} outputs {first}, last {last}; detokenized "
          f"{sum(decoded[:WINDOW])} / {sum(decoded[-WINDOW:])} ids; Job.update "
          f"{sum(seconds[:WINDOW]) * 1e3:.2f} / {sum(seconds[-WINDOW:]) * 1e3:.2f} ms")
    assert last <= 1.5 * first, (first, last)
    assert sum(decoded[-WINDOW:]) <= 1.5 * sum(decoded[:WINDOW])

    # The pieces add up: the same request unstreamed gives the same text.
    monkeypatch.undo()
    (full,) = post(app, body)
    assert json.loads(full)["choices"][0]["text"] == streamed
