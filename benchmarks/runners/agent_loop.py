"""A 10-turn agent loop through LangChain, unmodified, against `kvmemo serve`: ~2,000 tokens of
tool definitions, every turn a tool call and its result, as an agent framework sends them.

    python -m benchmarks.runners.agent_loop

Each turn LangChain's ChatOpenAI(...).bind_tools(TOOLS, tool_choice="required") sends the whole
conversation; the "tool" runs here (a fixed, made-up result) and the loop goes on. Per turn:
prompt tokens, cached tokens (the server's usage), the cache-hit share, and the time to first
token from the server's own log line. Writes benchmarks/results/agent_loop.json.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.machine_info import cpu_label
from benchmarks.paths import RESULTS
from benchmarks.server_process import running_server

TURNS = 10
_AREAS = [
    ("get_weather", "the current weather and a three-day forecast for a city",
     {"city": "string", "unit": ["C", "F"]}),
    ("search_web", "a web search; returns the top results with titles, links and snippets",
     {"query": "string", "max_results": "integer"}),
    ("read_file", "the text of a file in the user's workspace, by path",
     {"path": "string"}),
    ("write_file", "writes text to a file in the user's workspace, replacing it",
     {"path": "string", "content": "string"}),
    ("run_sql", "a read-only SQL query against the analytics warehouse",
     {"query": "string", "limit": "integer"}),
    ("send_email", "sends an email from the user's account",
     {"to": "string", "subject": "string", "body": "string"}),
    ("create_event", "creates a calendar event for the user",
     {"title": "string", "start": "string", "minutes": "integer"}),
    ("list_events", "the user's calendar events between two dates",
     {"start": "string", "end": "string"}),
    ("convert_currency", "converts an amount between currencies at today's rate",
     {"amount": "number", "source": "string", "target": "string"}),
    ("translate", "translates a text into another language",
     {"text": "string", "language": "string"}),
    ("get_stock_price", "the latest price and day change of a listed stock",
     {"ticker": "string"}),
    ("create_ticket", "opens a ticket in the team's issue tracker",
     {"title": "string", "priority": ["low", "medium", "high"], "body": "string"}),
]
_GUIDANCE = (
    " Use it only when the user's request needs it; prefer one call with complete arguments "
    "over several partial ones. Arguments must be exact: do not invent values the user did "
    "not give, ask instead. Results are returned as plain text and may be long; summarise "
    "them for the user rather than repeating them in full."
)


def make_tools() -> list[dict]:
    """12 OpenAI function tools, ~2,000 tokens of definitions as the fallback renders them."""
    tools = []
    for name, what, params in _AREAS:
        properties = {}
        for key, kind in params.items():
            spec = {"enum": kind} if isinstance(kind, list) else {"type": kind}
            spec["description"] = f"The {key.replace('_', ' ')} for {name.replace('_', ' ')}."
            if kind == "string":
                spec["maxLength"] = 40
            properties[key] = spec
        tools.append({"type": "function", "function": {
            "name": name, "description": f"Returns {what}." + _GUIDANCE,
            "parameters": {"type": "object", "properties": properties,
                           "required": list(params)},
        }})
    return tools


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_loop(url: str, model: str, tools: list[dict]) -> list[dict]:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=f"{url}/v1", api_key="unused", model=model, temperature=0,
                      max_tokens=96, max_retries=0)
    bound = chat.bind_tools(tools, tool_choice="required", parallel_tool_calls=False)
    history: list = [HumanMessage(
        "Plan my trip to Oslo next week: check the weather, the exchange rate from euros, "
        "my calendar, and email Ada the plan."
    )]
    turns = []
    for turn in range(1, TURNS + 1):
        start = time.perf_counter()
        reply = bound.invoke(history)
        latency = time.perf_counter() - start
        usage = reply.response_metadata["token_usage"]
        prompt = usage["prompt_tokens"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        call = reply.tool_calls[0]
        turns.append({"turn": turn, "prompt_tokens": prompt, "cached_tokens": cached,
                      "hit_rate": round(cached / prompt, 4), "latency_s": round(latency, 3),
                      "tool": call["name"]})
        print(json.dumps(turns[-1]), flush=True)
        history += [reply, ToolMessage(
            f"(result {turn} of {call['name']}): done; nothing unusual to report.",
            tool_call_id=call["id"],
        )]
    return turns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    port = args.port or _free_port()
    tools = make_tools()
    with tempfile.TemporaryDirectory(prefix="kvmemo-agent-") as tmp:
        log = Path(tmp) / "serve.log"
        command = [sys.executable, "-m", "kvmemo.cli", "serve", "--port", str(port),
                   "--served-model-name", "smollm2", "--max-model-len", "8192"]
        with running_server(command, port, log_path=log) as url:
            import httpx

            tool_tokens = httpx.post(f"{url}/tokenize", json={
                "messages": [{"role": "user", "content": "x"}], "tools": tools}).json()["count"]
            bare = httpx.post(f"{url}/tokenize", json={
                "messages": [{"role": "user", "content": "x"}]}).json()["count"]
            turns = run_loop(url, "smollm2", tools)
            time.sleep(0.5)  # the last request's log line
            ttfts = [float(t) for t in re.findall(r"ttft ([0-9.]+) s", log.read_text())]
    for turn, ttft in zip(turns, ttfts[-len(turns):]):
        turn["ttft_s"] = ttft
    summary = {
        "machine": cpu_label(),
        "client": "langchain-openai ChatOpenAI.bind_tools(tool_choice='required')",
        "tool_definition_tokens": tool_tokens - bare,
        "turns": turns,
        "min_hit_rate_from_turn_2": min(t["hit_rate"] for t in turns[1:]),
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "turns"}, indent=2))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "agent_loop.json").write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
