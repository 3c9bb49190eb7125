"""OpenAI's Responses API on a real `kvmemo serve`, through the unmodified `openai` SDK: text,
streamed events (the same text), a function call and its output, previous_response_id chains
over six turns that reuse every token computed before, a stored response retrieved and deleted,
text.format json_schema, 4xx naming the field, stored responses surviving a restart with a
disk KV store; and the OpenAI Agents SDK (openai-agents),
unmodified, running a tool-using agent over two turns, the second reading the first from the
prefix cache."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from tests.engine.test_tool_calls import WEATHER
from tests.server.conftest import launch_server

pytestmark = pytest.mark.model

FUNCTION = {"type": "function", **WEATHER["function"]}


@pytest.fixture(scope="module")
def server():
    with launch_server("--num-blocks", "1024", "--max-model-len", "4096") as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def test_text_and_streamed_events_agree(server, client):
    model = server.model_name()
    ask = {"model": model, "input": "Name a colour.", "instructions": "Answer in one word.",
           "max_output_tokens": 12, "temperature": 0}
    plain = client.responses.create(**ask)
    assert plain.object == "response" and plain.status in ("completed", "incomplete")
    assert plain.output_text and plain.usage.output_tokens >= 1
    events = list(client.responses.create(**ask, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" and "response.output_text.done" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == plain.output_text == events[-1].response.output_text


def test_function_call_and_its_output(server, client):
    model = server.model_name()
    first = client.responses.create(model=model, input="What is the weather in Oslo, in Celsius?",
                                    tools=[FUNCTION], tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=80,
                                    temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    json.loads(calls[0].arguments)
    second = client.responses.create(
        model=model, previous_response_id=first.id, tools=[FUNCTION], max_output_tokens=24,
        temperature=0, input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                               "output": "4 C and windy"}])
    assert second.previous_response_id == first.id and second.output
    computed = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= computed - 16


def test_a_streamed_function_call_sends_its_arguments_as_generated(server, client):
    model = server.model_name()
    ask = {"model": model, "input": "What is the weather in Oslo, in Celsius?",
           "tools": [FUNCTION], "tool_choice": "required", "parallel_tool_calls": False,
           "max_output_tokens": 80, "temperature": 0}
    plain = [i for i in client.responses.create(**ask).output if i.type == "function_call"]
    events = list(client.responses.create(**ask, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    # the item opens before its arguments, which come in pieces as they are generated
    assert kinds.index("response.output_item.added") < kinds.index(deltas[0].type)
    assert len(deltas) > 1
    done = [e.item for e in events if e.type == "response.output_item.done"]
    final = [i for i in events[-1].response.output if i.type == "function_call"]
    assert [i.model_dump() for i in done] == [i.model_dump() for i in final]
    assert "".join(d.delta for d in deltas) == final[0].arguments
    assert {d.item_id for d in deltas} == {final[0].id}
    assert [(c.name, json.loads(c.arguments)) for c in final] == [
        (c.name, json.loads(c.arguments)) for c in plain]


def test_a_six_turn_chain_reuses_every_earlier_token(server, client):
    model = server.model_name()
    previous = None
    for turn in range(6):
        reply = client.responses.create(
            model=model, input=f"Turn {turn}: name one more fruit.", max_output_tokens=12,
            temperature=0, previous_response_id=None if previous is None else previous.id)
        if previous is not None:  # all but the last, partly filled block of what came before
            computed = previous.usage.input_tokens + previous.usage.output_tokens
            assert reply.usage.input_tokens_details.cached_tokens >= computed - 16, turn
        previous = reply


def test_a_stored_response_is_retrieved_then_deleted(server, client):
    model = server.model_name()
    made = client.responses.create(model=model, input="Say hi.", max_output_tokens=4)
    got = client.responses.retrieve(made.id)
    assert got.id == made.id and got.output_text == made.output_text
    client.responses.delete(made.id)
    with pytest.raises(Exception) as gone:
        client.responses.retrieve(made.id)
    assert getattr(gone.value, "status_code", None) == 404
    unstored = client.responses.create(model=model, input="Say hi.", max_output_tokens=4,
                                       store=False)
    with pytest.raises(Exception):
        client.responses.retrieve(unstored.id)


def test_json_schema_output_validates(server, client):
    model = server.model_name()
    schema = {"type": "object", "properties": {"city": {"type": "string"},
                                               "celsius": {"type": "integer"}},
              "required": ["city", "celsius"], "additionalProperties": False}
    reply = client.responses.create(
        model=model, input="Give a city and its temperature.", max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "weather", "schema": schema}})
    jsonschema.validate(json.loads(reply.output_text), schema)


def test_bad_requests_name_the_field(server):
    with server.http() as http:
        unknown = http.post("/v1/responses", json={"input": "hi", "previous_response_id": "nope"})
        tool = http.post("/v1/responses", json={"input": "hi", "tools": [{"type": "web_search"}]})
        item = http.post("/v1/responses", json={"input": [{"type": "mystery"}]})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "previous_response_id"
    assert tool.status_code == 400 and tool.json()["error"]["param"] == "tools"
    assert item.status_code == 400 and item.json()["error"]["param"] == "input"


def test_the_openai_agents_sdk_runs_a_two_turn_tool_agent(server):
    pytest.importorskip("agents")
    from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_responses import OpenAIResponsesModel
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no export to OpenAI's servers
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"4 C and windy in {city}"

    client = AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    agent = Agent(
        name="weather", instructions="You answer questions about the weather.",
        tools=[get_weather],
        model=OpenAIResponsesModel(model=server.model_name(), openai_client=client),
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=80),
        # a 135M model asked for a tool keeps asking: the tool's answer ends each turn
        tool_use_behavior="stop_on_first_tool",
    )

    async def conversation():
        first = await Runner.run(agent, "What is the weather in Oslo?", max_turns=3)
        history = first.to_input_list() + [{"role": "user", "content": "And in Bergen?"}]
        second = await Runner.run(agent, history, max_turns=3)
        return first, second

    before = server.metrics()["kvmemo_prefix_cache_hit_tokens"]
    first, second = asyncio.run(conversation())
    reused = server.metrics()["kvmemo_prefix_cache_hit_tokens"] - before
    assert first.final_output == "4 C and windy in Oslo"
    assert second.final_output == "4 C and windy in Bergen"
    assert cities == ["Oslo", "Bergen"]
    assert reused >= 150  # turn 2 read turn 1's prompt and call from the cache


def test_stored_responses_survive_a_restart_with_a_disk_store(tmp_path):
    """With --kv-store disk:..., a stored response is there after a restart (a deleted one is
    not), and a follow-up to it reuses every earlier token: the conversation from the response
    log, its KV from the disk store."""
    flags = ("--num-blocks", "256", "--max-model-len", "2048", "--kv-store", f"disk:{tmp_path}")
    with launch_server(*flags) as first_run:
        client = first_run.openai()
        model = first_run.model_name()
        kept = client.responses.create(
            model=model, instructions="You name fruits.", input="Name one fruit, then stop.",
            max_output_tokens=24, temperature=0)
        gone = client.responses.create(model=model, input="Say hi.", max_output_tokens=4,
                                       temperature=0)
        client.responses.delete(gone.id)
    with launch_server(*flags) as second_run:
        client = second_run.openai()
        assert client.responses.retrieve(kept.id).output_text == kept.output_text
        from openai import NotFoundError

        with pytest.raises(NotFoundError):
            client.responses.retrieve(gone.id)
        follow_up = client.responses.create(
            model=model, previous_response_id=kept.id, input="And another one?",
            max_output_tokens=8, temperature=0)
        computed = kept.usage.input_tokens + kept.usage.output_tokens
        assert follow_up.usage.input_tokens_details.cached_tokens >= computed - 16
