"""The OpenAI-compatible server end to end: a real `kvmemo serve` process, driven by the
`openai` client and raw HTTP."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from tests.server.conftest import launch_server

pytestmark = pytest.mark.model

API_KEY = "test-key"
MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def server():
    with launch_server(
        "--num-blocks",
        "512",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-num-seqs",
        "32",
        api_key=API_KEY,
    ) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


@pytest.fixture(scope="module")
def model(server):
    return server.model_name()


def _long_prompt(words: int = 150) -> str:
    # A unique head keeps earlier tests' cache entries from matching.
    return f"[{uuid.uuid4().hex}] " + " ".join(f"item{i} is number {i}." for i in range(words // 4))


def _wait_until_idle(server, timeout_s: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        if m["kvmemo_kv_blocks_in_use"] == 0 and m["kvmemo_num_requests_running"] == 0:
            return m
        assert time.monotonic() < deadline, f"blocks still in use: {m['kvmemo_kv_blocks_in_use']}"
        time.sleep(0.2)


# ---- happy paths ----------------------------------------------------------------------------


def test_health_and_models(server, client, model):
    with server.http() as http:
        assert http.get("/health").json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == [model]


def test_completion_stream_matches_non_stream(client, model):
    kwargs = {
        "model": model,
        "prompt": "The capital of France is",
        "max_tokens": 8,
        "temperature": 0,
    }
    full = client.completions.create(**kwargs)
    choice = full.choices[0]
    assert choice.text and choice.finish_reason in ("length", "stop")
    assert full.usage.completion_tokens == 8 or choice.finish_reason == "stop"
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert (
        chunks[-1].choices == []
        and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason


def test_completion_accepts_token_ids(client, model):
    out = client.completions.create(
        model=model, prompt=[504, 3575, 282], max_tokens=3, temperature=0
    )
    assert out.usage.prompt_tokens == 3 and out.usage.completion_tokens == 3


def test_chat_stream_matches_non_stream_and_text_parts(client, model):
    messages = [{"role": "user", "content": "Say hello."}]
    full = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0
    )
    text = full.choices[0].message.content
    assert full.choices[0].message.role == "assistant" and text
    chunks = list(
        client.chat.completions.create(
            model=model, messages=messages, max_completion_tokens=8, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say hello."}]}]
    as_parts = client.chat.completions.create(
        model=model, messages=parts, max_tokens=8, temperature=0
    )
    assert as_parts.choices[0].message.content == text


def test_n_seed_and_logprobs(client, model):
    out = client.completions.create(
        model=model,
        prompt="Once upon a time",
        max_tokens=4,
        n=2,
        seed=7,
        temperature=1.0,
        logprobs=2,
    )
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in out.choices)
    for c in out.choices:
        assert len(c.logprobs.token_logprobs) == len(c.logprobs.tokens)
        assert all(len(top) <= 2 for top in c.logprobs.top_logprobs)
    again = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=4, n=2, seed=7, temperature=1.0
    )
    assert [c.text for c in again.choices] == [c.text for c in out.choices]
    streamed = ["", ""]
    for chunk in client.completions.create(
        model=model,
        prompt="Once upon a time",
        max_tokens=4,
        n=2,
        seed=7,
        temperature=1.0,
        stream=True,
    ):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [c.text for c in out.choices]
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert content[0].top_logprobs[0].logprob == content[0].logprob  # greedy picks the top token


def test_repeated_long_prompt_is_cached_and_salt_isolates(client, model):
    prompt = _long_prompt()
    first = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens > 64
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.choices[0].text == first.choices[0].text
    salted = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=2,
        temperature=0,
        extra_body={"cache_salt": "tenant-a"},
    )
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    salted_again = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=2,
        temperature=0,
        extra_body={"cache_salt": "tenant-a"},
    )
    assert salted_again.usage.prompt_tokens_details.cached_tokens > 0


def test_concurrent_streams_match_sequential(client, model):
    prompts = [f"Write a short fact about the number {i}." for i in range(16)]

    def ask(i: int, stream: bool) -> str:
        messages = [{"role": "user", "content": prompts[i]}]
        if not stream:
            out = client.chat.completions.create(
                model=model, messages=messages, max_tokens=6, temperature=0
            )
            return out.choices[0].message.content
        chunks = client.chat.completions.create(
            model=model, messages=messages, max_tokens=6, temperature=0, stream=True
        )
        return "".join(c.choices[0].delta.content or "" for c in chunks)

    sequential = [ask(i, stream=False) for i in range(16)]
    concurrent: list[str | BaseException | None] = [None] * 16
    start = threading.Barrier(16)

    def worker(i: int) -> None:
        try:
            start.wait()
            concurrent[i] = ask(i, stream=True)
        except BaseException as e:  # surfaced by the assert below
            concurrent[i] = e

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert concurrent == sequential


def test_aborted_stream_frees_blocks(server, model):
    _wait_until_idle(server)
    before = server.metrics()["kvmemo_generation_tokens_total"]
    body = {
        "model": model,
        "prompt": "Count forever: 1, 2, 3,",
        "max_tokens": 900,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with server.http() as http, http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # one chunk, then hang up
    after = _wait_until_idle(server)
    # The request was cut short: far fewer than 900 tokens were generated before the abort.
    assert after["kvmemo_generation_tokens_total"] - before < 900


def test_disconnected_non_stream_request_is_aborted(server, model):
    import httpx

    _wait_until_idle(server)
    before = server.metrics()["kvmemo_generation_tokens_total"]
    body = {
        "model": model,
        "prompt": "Count forever: 1, 2, 3,",
        "max_tokens": 900,
        "temperature": 0,
        "ignore_eos": True,
    }
    with (
        pytest.raises(httpx.ReadTimeout),
        server.http(timeout=httpx.Timeout(120, read=1.0)) as http,
    ):
        http.post("/v1/completions", json=body)
    after = _wait_until_idle(server)
    assert after["kvmemo_generation_tokens_total"] - before < 900


# ---- errors ---------------------------------------------------------------------------------


def _error(
    server, path: str, body, *, headers: dict[str, str] | None = None, status: int = 400
) -> dict:
    with server.http() as http:
        if headers is not None:
            http.headers.clear()
            http.headers.update(headers)
        if isinstance(body, str):
            response = http.post(path, content=body, headers={"Content-Type": "application/json"})
        else:
            response = http.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_bad_temperature_is_400(server, client, model):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="hi", max_tokens=2, temperature=-1)
    assert info.value.status_code == 400
    assert "temperature" in info.value.body["message"] and info.value.body["param"] == "temperature"


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, "model", "unknown model"),
        ("/v1/completions", {"prompt": list(range(MAX_MODEL_LEN + 10))}, "prompt", "context"),
        (
            "/v1/completions",
            {"prompt": "hi", "presence_penalty": 2.5},
            "presence_penalty",
            "[-2, 2]",
        ),
        ("/v1/completions", {"prompt": "hi", "best_of": 3}, "best_of", "not supported"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias", "token ids"),
        (
            "/v1/completions",
            {"prompt": "hi", "logit_bias": {"99999999": 1}},
            "logit_bias",
            "token ids must be in",
        ),
        ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty", "> 0"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "min_tokens": 5},
            "min_tokens",
            "max_tokens",
        ),
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompt", "batches"),
        ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p", "top_p"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens", "max_tokens"),
        (
            "/v1/completions",
            {"prompt": "hi", "stream_options": {"include_usage": True}},
            None,
            "stream",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages", "content"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "wizard", "content": "hi"}]},
            "messages",
            "role",
        ),
        ("/v1/chat/completions", {"messages": "hello"}, "messages", "messages"),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is this?"},
                            {
                                "type": "image_url",
                                "image_url": {"url": "data:image/png;base64,AAAA"},
                            },
                        ],
                    }
                ]
            },
            "messages",
            "does not accept images",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            "top_logprobs",
            "logprobs",
        ),
    ],
)
def test_invalid_requests_are_400(server, path, body, param, words):
    error = _error(server, path, body)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert words in error["message"]


@pytest.mark.parametrize("body", ["{not json", "[1, 2]", "42"])
def test_malformed_json_is_400(server, body):
    error = _error(server, "/v1/completions", body)
    assert "JSON" in error["message"]


def test_missing_or_wrong_key_is_401(server, model):
    import openai

    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        error = _error(server, "/v1/completions", {"prompt": "hi"}, headers=headers, status=401)
        assert error["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        server.openai().with_options(api_key="wrong").models.list()
    with server.http() as http:
        http.headers.clear()
        assert http.get("/health").status_code == 200  # health and metrics stay open
        assert http.get("/metrics").status_code == 200


def test_reset_prefix_cache_needs_key(server):
    _error(server, "/reset_prefix_cache", {}, headers={}, status=401)
    _wait_until_idle(server)
    with server.http() as http:
        response = http.post("/reset_prefix_cache")
    assert response.status_code == 200 and response.json() == {"success": True}


# ---- metrics --------------------------------------------------------------------------------


def test_metrics_parse_and_move(server, client, model):
    before = server.metrics()
    for name in (
        "kvmemo_kv_blocks_in_use",
        "kvmemo_num_requests_running",
        "kvmemo_num_requests_waiting",
        "kvmemo_prefix_cache_hit_rate",
        "kvmemo_store_hit_tokens",
        "kvmemo_kv_blocks_total",
    ):
        assert name in before
    route = "kvmemo_requests_total{route=/v1/completions,status=200}"
    out = client.completions.create(
        model=model, prompt="Metrics move when", max_tokens=3, temperature=0
    )
    after = server.metrics()
    assert after[route] == before.get(route, 0) + 1
    assert (
        after["kvmemo_prompt_tokens_total"] - before["kvmemo_prompt_tokens_total"]
        == out.usage.prompt_tokens
    )
    assert after["kvmemo_generation_tokens_total"] - before["kvmemo_generation_tokens_total"] == 3
    assert (
        after["kvmemo_e2e_request_latency_seconds_count"]
        == before["kvmemo_e2e_request_latency_seconds_count"] + 1
    )
    assert (
        after["kvmemo_time_to_first_token_seconds_count"]
        > before["kvmemo_time_to_first_token_seconds_count"]
    )
    bad = "kvmemo_requests_total{route=/v1/completions,status=400}"
    _error(server, "/v1/completions", {"prompt": "hi", "temperature": -1})
    assert server.metrics()[bad] == after.get(bad, 0) + 1


def test_server_logs_one_line_per_request(server):
    assert "prompt" in server.log() and "cached" in server.log() and "latency" in server.log()


def test_unknown_fields_are_ignored_and_named_in_a_header(server, model):
    """vLLM's extras from other servers' clients (e.g. vllm bench serve) do not fail a request."""
    body = {"model": model, "prompt": "hi", "max_tokens": 2, "frobnicate": True, "zz_top": 1}
    with server.http() as http:
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.headers["kvmemo-ignored-fields"] == "frobnicate,zz_top"
        plain = http.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2})
        assert "kvmemo-ignored-fields" not in plain.headers
        chat = http.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "stream": True, "frobnicate": 1,
        })
        assert chat.status_code == 200 and chat.headers["kvmemo-ignored-fields"] == "frobnicate"
    assert server.log().count("ignoring unknown request field 'frobnicate'") == 1


def test_penalties_and_logit_bias_reach_the_sampler(client, model):
    base = dict(model=model, prompt="The three primary colours are", max_tokens=8, temperature=0)
    plain = client.completions.create(**base)
    forced = client.completions.create(**base, logit_bias={"5000": 100})  # +100 beats any logit
    assert forced.choices[0].text == " properly" * 8  # SmolLM2's token 5000, every step
    penalized = client.completions.create(**base, frequency_penalty=2.0, presence_penalty=2.0,
                                          extra_body={"repetition_penalty": 1.8})
    assert penalized.choices[0].text != plain.choices[0].text


def test_structured_output_in_each_dialect(server, client, model):
    """OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields."""
    import json
    import re

    import jsonschema

    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
              "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
              "required": ["answer", "confidence"]}
    messages = [{"role": "user", "content": "Is the sea salty? Answer in JSON."}]
    reply = client.chat.completions.create(
        model=model, messages=messages, max_tokens=40, temperature=0.8, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    )
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    obj = client.chat.completions.create(model=model, messages=messages, max_tokens=60,
                                         temperature=0, response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    choice = client.completions.create(model=model, prompt="Pick a colour:", max_tokens=5,
                                       extra_body={"guided_choice": ["red", "green"]})
    assert choice.choices[0].text in ("red", "green")
    with server.http() as http:
        regex = http.post("/v1/completions", json={
            "model": model, "prompt": "A date:", "max_tokens": 20, "temperature": 1.0, "seed": 4,
            "structured_outputs": {"regex": r"20[0-9]{2}-(0[1-9]|1[0-2])"}, "stream": True,
        })
        assert regex.status_code == 200
        text = "".join(
            json.loads(line[6:])["choices"][0]["text"] for line in regex.text.splitlines()
            if line.startswith("data: {")
        )
        assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])", text), text


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "set one"),
        ({"structured_outputs": {"json": {"type": "nonsense"}}}, "structured_outputs", "invalid"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs json_schema"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "one of"),
        ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ],
)
def test_bad_structured_output_is_400(server, model, extra, param, words):
    with server.http() as http:
        response = http.post("/v1/completions",
                             json={"model": model, "prompt": "hi", "max_tokens": 2, **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_echo_with_logprobs_gives_hf_prompt_logprobs(server, model, hf_model, smollm_gguf):
    """lm-eval's loglikelihood request: token-id prompt, echo, logprobs 1, max_tokens 1."""
    import json

    import torch

    text = "The quick brown fox jumps over the lazy dog because"
    with server.http() as http:
        ids = http.post("/tokenize", json={"model": model, "prompt": text}).json()["tokens"]
        body = {"model": model, "prompt": [ids], "max_tokens": 1, "logprobs": 1, "echo": True,
                "temperature": 0}
        full = http.post("/v1/completions", json=body).json()["choices"][0]
        streamed = http.post("/v1/completions", json={**body, "stream": True}).text
        vllm_style = http.post("/v1/completions", json={
            "model": model, "prompt": [ids], "max_tokens": 1, "prompt_logprobs": 2,
        }).json()["choices"][0]
    with torch.inference_mode():
        logits = hf_model(input_ids=torch.tensor([ids])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)
    lp = full["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None
    for p in range(1, len(ids)):
        assert abs(lp["token_logprobs"][p] - float(expected[p - 1, ids[p]])) < 1e-3
        best = max(lp["top_logprobs"][p].values())
        assert abs(best - float(expected[p - 1].max())) < 1e-3
    assert abs(lp["token_logprobs"][-1] - float(expected[-1].max())) < 1e-3  # greedy next token
    assert full["text"].startswith(text) and len(full["text"]) > len(text)
    assert lp["text_offset"][0] == 0 and lp["text_offset"][-1] == len(text)
    chunks = [json.loads(line[6:]) for line in streamed.splitlines()
              if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["text"]
    streamed_lp = [v for c in chunks if c["choices"][0]["logprobs"]
                   for v in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed_lp == lp["token_logprobs"]
    prompt_lp = vllm_style["prompt_logprobs"]
    assert prompt_lp[0] is None and len(prompt_lp) == len(ids)
    assert abs(prompt_lp[1][str(ids[1])]["logprob"] - float(expected[0, ids[1]])) < 1e-3
    assert 2 <= len(prompt_lp[1]) <= 3 and vllm_style["text"]


def test_tokenize_detokenize_and_version(server, model):
    with server.http() as http:
        text = http.post("/tokenize", json={"model": model, "prompt": "Hello world"}).json()
        assert text["count"] == len(text["tokens"]) > 1
        assert text["max_model_len"] == MAX_MODEL_LEN
        back = http.post("/detokenize", json={"model": model, "tokens": text["tokens"]}).json()
        assert back["prompt"] == "Hello world"
        chat = http.post("/tokenize", json={
            "model": model, "messages": [{"role": "user", "content": "Hello world"}],
        }).json()
        rendered = http.post("/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
        assert "Hello world" in rendered and rendered.rstrip().endswith("assistant")
        # What /tokenize counts is what a chat request's usage counts.
        reply = http.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "Hello world"}],
            "max_tokens": 1,
        }).json()
        assert reply["usage"]["prompt_tokens"] == chat["count"]
        bad = http.post("/detokenize", json={"tokens": [10**7]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
        both = http.post("/tokenize", json={"prompt": "a", "messages": [
            {"role": "user", "content": "a"}]})
        assert both.status_code == 400
        assert http.post("/tokenize", json={"model": "other", "prompt": "a"}).status_code == 400
        version = http.get("/version").json()["version"]
        assert version and version[0].isdigit()
    import httpx

    with httpx.Client(base_url=server.base_url) as anonymous:  # the key guards the POST routes
        assert anonymous.post("/tokenize", json={"prompt": "a"}).status_code == 401


def test_continuous_usage_stats_put_usage_in_every_chunk(server, model):
    """vLLM's stream option (guidellm sends it): usage so far in each content chunk."""
    import json

    with server.http() as http:
        text = http.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "Count to five."}],
            "max_tokens": 6, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }).text
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    counted = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert counted[0] == 0  # the assistant-role opening chunk
    assert counted[-1] == 6 and counted == sorted(counted) and counted[1] >= 1
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


def test_vllm_chat_and_prompt_extras(server, model):
    """add_generation_prompt, continue_final_message with echo, truncate_prompt_tokens,
    return_tokens_as_token_ids and request_id, with vLLM's meanings."""
    user = {"role": "user", "content": "What colour is the sky?"}
    started = {"role": "assistant", "content": "The sky is"}
    with server.http() as http:
        def tokens(**body):
            response = http.post("/tokenize", json={"model": model, **body})
            assert response.status_code == 200, response.text
            return response.json()["tokens"]

        with_header = tokens(messages=[user])
        without = tokens(messages=[user], add_generation_prompt=False)
        assert with_header[: len(without)] == without and len(with_header) > len(without)
        continued = tokens(messages=[user, started], add_generation_prompt=False,
                           continue_final_message=True)
        tail = tokens(prompt="The sky is", add_special_tokens=False)
        assert continued[-len(tail):] == tail  # ends inside the assistant's message
        reply = http.post("/v1/chat/completions", json={
            "model": model, "messages": [user, started], "max_tokens": 4, "temperature": 0,
            "add_generation_prompt": False, "continue_final_message": True, "echo": True,
            "chat_template_kwargs": {"unused_variable": 1},
        }).json()
        content = reply["choices"][0]["message"]["content"]
        assert content.startswith("The sky is") and len(content) > len("The sky is")
        assert reply["usage"]["prompt_tokens"] == len(continued)
        both = http.post("/v1/chat/completions", json={
            "model": model, "messages": [user, started], "continue_final_message": True})
        assert both.status_code == 400
        assert both.json()["error"]["param"] == "continue_final_message"
        long_prompt = " ".join(f"word{i}" for i in range(200))
        cut = http.post("/v1/completions", json={
            "model": model, "prompt": long_prompt, "max_tokens": 1,
            "truncate_prompt_tokens": 8, "logprobs": 1, "return_tokens_as_token_ids": True,
            "request_id": "my-request-7",
        }).json()
        assert cut["usage"]["prompt_tokens"] == 8 and cut["id"] == "cmpl-my-request-7"
        token = cut["choices"][0]["logprobs"]["tokens"][0]
        assert token.startswith("token_id:") and token[9:].isdigit()
        full = http.post("/v1/completions", json={
            "model": model, "prompt": long_prompt, "max_tokens": 1, "truncate_prompt_tokens": -1,
        }).json()
        assert full["usage"]["prompt_tokens"] > 200
        custom = http.post("/v1/chat/completions", json={
            "model": model, "messages": [user], "max_tokens": 1,
            "chat_template": "{% for m in messages %}<<{{ m.content }}>>{% endfor %}",
        }).json()
        assert custom["usage"]["prompt_tokens"] == len(tokens(prompt="<<What colour is the sky?>>"))
        broken = http.post("/v1/chat/completions", json={
            "model": model, "messages": [user], "chat_template": "{% raise_exception('no') %}"})
        assert broken.status_code == 400 and broken.json()["error"]["param"] == "messages"


def test_vllm_structured_output_options_and_unimplemented_extras(server, model):
    """vLLM's structured_outputs backend options are accepted (they change nothing here); its
    extras that kvmemo does not implement are 400s naming them, never silently ignored."""
    with server.http() as http:
        ok = http.post("/v1/completions", json={
            "model": model, "prompt": "Pick:", "max_tokens": 4,
            "structured_outputs": {"choice": ["a", "b"], "disable_any_whitespace": True,
                                   "disable_fallback": True},
        })
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] in ("a", "b")
        for field, value in (("use_beam_search", True), ("logits_processors", ["x"]),
                             ("guided_whitespace_pattern", " *")):
            bad = http.post("/v1/completions", json={
                "model": model, "prompt": "hi", "max_tokens": 2, field: value})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == field
        tag = http.post("/v1/completions", json={
            "model": model, "prompt": "hi", "max_tokens": 2,
            "structured_outputs": {"structural_tag": "{}"}})
        assert tag.status_code == 400


# ---- chunk KV reuse (kv_reuse="blend") ------------------------------------------------------


def _doc(name: str) -> str:
    return (
        f"Notes on {name}. " + " ".join(f"{name} item {i} weighs {i * 3} grams." for i in range(12))
        + "\n\n"
    )


def test_segments_and_documents_blend_and_report_reuse(server, model):
    tag = uuid.uuid4().hex[:8]
    context = f"<|im_start|>system\n[{tag}] Answer from the notes.\n"
    ask = "<|im_end|>\n<|im_start|>user\nWhat does item 4 weigh?<|im_end|>\n<|im_start|>assistant\n"
    docs = [_doc(f"box{k}") for k in range(3)]
    with server.http() as http:
        def complete(order, **extra):
            body = {"model": model, "segments": [context, *(docs[k] for k in order), ask],
                    "max_tokens": 4, "temperature": 0, **extra}
            response = http.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()["usage"]["prompt_tokens_details"]

        cold = complete([0, 1, 2], kv_reuse="blend")
        assert cold["blended_tokens"] == 0  # nothing cached yet: an exact prefill
        _wait_until_idle(server)  # its chunks are computed after its first token
        warm = complete([2, 0, 1], kv_reuse="blend", recompute_ratio=0.2)
        assert warm["blended_tokens"] > 60 and warm["recomputed_tokens"] > 0
        plain = complete([2, 0, 1])
        assert "blended_tokens" not in plain  # prefix caching: the default
        chat = http.post("/v1/chat/completions", json={
            "model": model, "max_tokens": 4, "temperature": 0, "kv_reuse": "blend",
            "messages": [{"role": "user", "content": "What does box1 item 4 weigh?"}],
            "documents": [d.strip() for d in docs],
        })
        assert chat.status_code == 200, chat.text
        assert "blended_tokens" in chat.json()["usage"]["prompt_tokens_details"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"segments": ["only one"]}, "segments"),
        ({"segments": ["context", "", "question"]}, "segments[1]"),
        ({"segments": ["context", {"text": "x"}, "question"]}, "segments[1]"),
        ({"segments": ["a", "b"], "prompt": "c"}, None),
        ({"segments": ["a", "b"], "kv_reuse": "approximate"}, None),
        ({"segments": ["a", "b"], "recompute_ratio": 2}, None),
    ],
)
def test_bad_segments_are_400(server, model, body, param):
    with server.http() as http:
        response = http.post("/v1/completions", json={"model": model, "max_tokens": 2, **body})
    assert response.status_code == 400, response.text
    if param is not None:
        assert response.json()["error"]["param"] == param


def test_bad_documents_are_400(server, model):
    with server.http() as http:
        response = http.post("/v1/chat/completions", json={
            "model": model, "max_tokens": 2, "documents": ["fine", 3],
            "messages": [{"role": "user", "content": "hi"}],
        })
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "documents[1]"
