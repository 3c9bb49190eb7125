"""Anthropic's Messages API on a real `kvmemo serve`, through the unmodified `anthropic` SDK:
a plain and a streamed request (the same text), a tool round trip (tool_use -> tool_result),
cache_control's usage (creation on the first request, reads on the next), a six-turn tool loop
that reuses what the previous turn computed, count_tokens, x-api-key auth, and Anthropic-shaped
400s naming the field."""

from __future__ import annotations

import pytest

anthropic = pytest.importorskip("anthropic")

from tests.engine.test_tool_calls import WEATHER  # noqa: E402
from tests.server.conftest import launch_server  # noqa: E402

pytestmark = pytest.mark.model

KEY = "sk-test-anthropic"
# temperature left the 2026 API (and its SDK's arguments); kvmemo still takes it
GREEDY = {"temperature": 0.0}
TOOLS = [{"name": WEATHER["function"]["name"], "description": WEATHER["function"]["description"],
          "input_schema": WEATHER["function"]["parameters"]}]


@pytest.fixture(scope="module")
def server():
    with launch_server("--num-blocks", "1024", "--max-model-len", "4096", api_key=KEY) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)


def _system(tag: str) -> list[dict]:
    text = (f"[{tag}] You are the assistant of a bicycle shop. We repair bikes, sell helmets, "
            "lights and locks, and rent city bikes by the day. Answer in one short sentence. ")
    return [{"type": "text", "text": text * 3, "cache_control": {"type": "ephemeral"}}]


def _total_input(usage) -> int:
    return (usage.input_tokens + usage.cache_read_input_tokens
            + usage.cache_creation_input_tokens)


def test_plain_and_streamed_give_the_same_message(server, client):
    model = server.model_name()
    ask = {"model": model, "max_tokens": 24, "extra_body": GREEDY, "system": _system("plain"),
           "messages": [{"role": "user", "content": "Do you rent bikes?"}]}
    plain = client.messages.create(**ask)
    assert plain.type == "message" and plain.role == "assistant" and plain.id.startswith("msg_")
    assert plain.content[0].type == "text" and plain.content[0].text
    assert plain.stop_reason in ("end_turn", "max_tokens")
    assert plain.usage.output_tokens >= 1
    with client.messages.stream(**ask) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == plain.content[0].text == final.content[0].text
    assert final.stop_reason == plain.stop_reason
    assert final.usage.output_tokens == plain.usage.output_tokens


def test_cache_control_reports_creation_then_reads(server, client):
    model = server.model_name()
    system = _system("cache")

    def ask(question: str):
        return client.messages.create(model=model, max_tokens=8, system=system,
                                      messages=[{"role": "user", "content": question}])

    first, second = ask("Do you sell helmets?"), ask("Can you fix a flat tyre?")
    # first: the system prompt is computed and stored (only the chat template's opening, shared
    # with the other tests' prompts, may be read)
    assert first.usage.cache_creation_input_tokens >= 96
    assert first.usage.cache_read_input_tokens < 16
    assert second.usage.cache_read_input_tokens >= 48  # the shared system prompt's blocks
    counted = client.messages.count_tokens(model=model, system=system, messages=[
        {"role": "user", "content": "Can you fix a flat tyre?"}])
    assert counted.input_tokens == _total_input(second.usage)


def test_tool_round_trip(server, client):
    model = server.model_name()
    history = [{"role": "user", "content": "What is the weather in Oslo, in Celsius?"}]
    first = client.messages.create(model=model, max_tokens=80, extra_body=GREEDY, tools=TOOLS,
                                   tool_choice={"type": "any"}, messages=history)
    assert first.stop_reason == "tool_use"
    call = next(block for block in first.content if block.type == "tool_use")
    assert call.name == "get_weather" and isinstance(call.input, dict) and call.id
    history += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                              "content": "4 C and windy"}]}]
    second = client.messages.create(model=model, max_tokens=24, extra_body=GREEDY, tools=TOOLS,
                                    messages=history)
    assert second.content and second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # what turn 1 sent and generated is reused (its last block may be partial)
    turn1 = _total_input(first.usage) + first.usage.output_tokens
    assert second.usage.cache_read_input_tokens >= turn1 - 16


def test_a_streamed_tool_use_sends_its_input_as_generated(server, client):
    model = server.model_name()
    ask = {"model": model, "max_tokens": 80, "extra_body": GREEDY, "tools": TOOLS,
           "tool_choice": {"type": "any"},
           "messages": [{"role": "user", "content": "What is the weather in Oslo, in Celsius?"}]}
    plain = client.messages.create(**ask)
    fragments: list[str] = []
    with client.messages.stream(**ask) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                fragments.append(event.delta.partial_json)
        final = stream.get_final_message()
    assert final.stop_reason == plain.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in final.content] \
        == [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in plain.content]
    assert len(fragments) > 1  # the input came in pieces as it was generated, not at the end


def test_a_six_turn_tool_loop_reuses_the_previous_turn(server, client):
    model = server.model_name()
    history: list[dict] = [{"role": "user", "content": "What is the weather in Oslo, in Celsius?"}]
    previous = None
    for turn in range(6):
        reply = client.messages.create(
            model=model, max_tokens=120, extra_body=GREEDY, tools=TOOLS, messages=history,
            tool_choice={"type": "any", "disable_parallel_tool_use": True})
        if previous is not None:  # from turn 2 on: all but a partial last block is read
            computed_before = _total_input(previous.usage) + previous.usage.output_tokens
            assert reply.usage.cache_read_input_tokens >= 0.95 * computed_before - 16, turn
        assert reply.stop_reason == "tool_use", (turn, reply)
        call = next(block for block in reply.content if block.type == "tool_use")
        history += [{"role": "assistant", "content": [b.model_dump() for b in reply.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                  "content": f"{turn + 3} C, city {turn}"}]}]
        previous = reply


def test_errors_are_anthropic_shaped_and_name_the_field(server, client):
    model = server.model_name()
    with pytest.raises(anthropic.BadRequestError) as bad_ttl:
        client.messages.create(model=model, max_tokens=8, messages=[
            {"role": "user", "content": [{"type": "text", "text": "hi",
                                          "cache_control": {"type": "ephemeral", "ttl": "2h"}}]}])
    body = bad_ttl.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "cache_control.ttl" in body["error"]["message"]
    with server.http() as http:  # max_tokens is required
        response = http.post("/v1/messages", json={
            "model": model, "messages": [{"role": "user", "content": "hi"}]},
            headers={"x-api-key": KEY})
    assert response.status_code == 400 and "max_tokens" in response.json()["error"]["message"]
    wrong = anthropic.Anthropic(base_url=server.base_url, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as denied:
        wrong.messages.create(model=model, max_tokens=8,
                              messages=[{"role": "user", "content": "hi"}])
    assert denied.value.body["error"]["type"] == "authentication_error"
