"""Tool calling through a real `kvmemo serve`: the openai SDK and LangChain's ChatOpenAI with
bind_tools, streaming deltas, cache hits across an agent turn, and 400s naming bad fields."""

from __future__ import annotations

import json

import pytest

from tests.engine.test_tool_calls import ADD, QUESTION, TOOLS, WEATHER
from tests.server.conftest import launch_server

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def server():
    with launch_server("--num-blocks", "512", "--max-model-len", "2048") as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def _call(client, model, **kwargs):
    options = {"messages": QUESTION, "tools": TOOLS, "max_tokens": 80, "temperature": 0.8,
               "seed": 3, **kwargs}
    return client.chat.completions.create(model=model, **options)


def test_round_trip_with_cache_hits(server, client):
    model = server.model_name()
    first = _call(client, model, tool_choice="required", parallel_tool_calls=False)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    json.loads(call.function.arguments)
    history = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "4 C and windy"},
    ]
    second = _call(client, model, messages=history, max_tokens=24, temperature=0)
    # Everything turn 1 sent and received is reused (the last block may be partial).
    turn1_tokens = first.usage.prompt_tokens + first.usage.completion_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= turn1_tokens - 1
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_streamed_calls_reassemble_into_the_full_response(server, client):
    model = server.model_name()
    named = {"type": "function", "function": {"name": "get_weather"}}
    full = _call(client, model, tool_choice=named, seed=11).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in _call(client, model, tool_choice=named, seed=11, stream=True):
        delta = chunk.choices[0].delta
        for part in delta.tool_calls or ():
            entry = calls.setdefault(part.index, {"name": "", "arguments": ""})
            entry["name"] += part.function.name or ""
            entry["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" == full.finish_reason
    expected = [{"name": c.function.name, "arguments": c.function.arguments}
                for c in full.message.tool_calls]
    assert [calls[i] for i in sorted(calls)] == expected
    # An answer in text under tool_choice auto streams as text, equal to the full one.
    plain = [{"role": "user", "content": "Say hello to Ada in one sentence."}]
    text = _call(client, model, messages=plain, tool_choice="none", temperature=0).choices[0]
    streamed = "".join(
        c.choices[0].delta.content or "" for c in
        _call(client, model, messages=plain, tool_choice="none", temperature=0, stream=True)
        if c.choices
    )
    assert streamed == text.message.content and text.finish_reason in ("stop", "length")


def test_history_renders_as_offline(server, llm):
    """The server (/tokenize with tools) and LLM.chat's intake render a history alike."""
    from kvmemo.tool_calls import tools_for_request

    history = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_9", "type": "function",
         "function": {"name": "add", "arguments": '{"a": 40, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "42"},
        {"role": "assistant", "content": "The answer is 42."},
        {"role": "user", "content": "Thanks. And the weather?"},
    ]
    with server.http() as http:
        served = http.post("/tokenize", json={"messages": history, "tools": TOOLS}).json()
    offline = tools_for_request(history, TOOLS, template=llm.processor.chat_template)
    assert served["tokens"] == llm.processor.process_chat(offline.messages).token_ids


def test_langchain_bind_tools_round_trip(server):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        base_url=f"{server.base_url}/v1", api_key="unused", model=server.model_name(),
        temperature=0, max_tokens=80, max_retries=0,
    )
    bound = chat.bind_tools([WEATHER, ADD], tool_choice="add")
    question = HumanMessage("What is 40 plus 2?")
    reply = bound.invoke([question])
    assert reply.tool_calls and reply.tool_calls[0]["name"] == "add"
    args = reply.tool_calls[0]["args"]
    assert set(args) == {"a", "b"} and all(isinstance(v, int) for v in args.values())
    result = ToolMessage(str(args["a"] + args["b"]), tool_call_id=reply.tool_calls[0]["id"])
    answer = chat.bind_tools([WEATHER, ADD]).invoke([question, reply, result])
    assert isinstance(answer.content, str)
    assert answer.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"type": "vector"}}}}}]},
         "tools", "not a JSON schema type"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice", "not a tool"),
        ({"tools": TOOLS, "messages": QUESTION + [
            {"role": "tool", "tool_call_id": "call_unknown", "content": "1"}]},
         "messages", "answers no earlier tool call"),
        ({"tools": TOOLS, "tool_choice": "required",
          "response_format": {"type": "json_object"}}, "tool_choice", "constrains"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ],
)
def test_bad_tools_are_400(server, extra, param, words):
    body = {"model": server.model_name(), "messages": QUESTION, "max_tokens": 4, **extra}
    with server.http() as http:
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
