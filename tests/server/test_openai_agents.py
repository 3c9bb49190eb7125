"""The OpenAI Agents SDK (openai-agents), unmodified, runs a tool-using agent over two turns
against a real `kvmemo serve` through the Responses API: each turn calls the function tool with
the city the user named, and the second turn's prompt (the first turn's items given back)
reads what the first computed from the prefix cache."""

from __future__ import annotations

import asyncio

import pytest

agents = pytest.importorskip("agents")

from tests.server.conftest import launch_server  # noqa: E402

pytestmark = pytest.mark.model


def test_a_two_turn_tool_agent(tmp_path):
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

    with launch_server("--num-blocks", "1024", "--max-model-len", "4096") as server:
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
