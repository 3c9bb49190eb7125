"""Agent loops through the agent-native APIs, unmodified SDKs against `kvmemo serve`, until the
conversation reaches about 8,000 tokens: Anthropic's Messages API (a cache_control'd system
prompt and tools, every turn a tool_use answered by a ~500-token tool_result) and OpenAI's
Responses API (previous_response_id, every turn a ~500-token document as input).

    python -m benchmarks.runners.agent_api_loop [--max-context 8000] [--output-tokens 24]
                                               [--engines kvmemo,kvmemo-dense,vllm]

Per turn: the prompt's tokens, the tokens read from the cache, the reuse of what the previous
turn computed (cached / (its prompt + its output), issue 42's goal: at least 99%), and the time
to first token as the client sees it (streamed: the first text or tool event). Writes
benchmarks/results/agent_api_loop.json.

Engines, one fresh server each, in the order given: `kvmemo` (the default mode), `kvmemo-dense`
(dense fp32 weights, vLLM's dtype) and `vllm` (`vllm serve` from benchmarks/peers/.venv-vllm on
the fp32 checkpoint of the same GGUF, run as its CPU docs advise (run_suite.engine_env), prefix
caching on, its Anthropic and Responses routes, VLLM_ENABLE_RESPONSES_API_STORE=1 so that
previous_response_id works, hermes tool calls and the ChatML-with-tools template kvmemo's
fallback renders). Each engine generates its own greedy replies, so the conversations match in
shape and length, not token for token.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from typing import Any

from benchmarks.machine_info import cpu_label
from benchmarks.paths import PEERS, RESULTS
from benchmarks.runners.run_suite import engine_env
from benchmarks.runners.serve_bench import server_command
from benchmarks.server_process import running_server

SYSTEM = ("You are a research agent. You read the documents the tools return and answer in one "
          "short sentence, calling lookup when you need another document. ") * 6
LOOKUP = {"name": "lookup", "description": "Fetch the next document of the research folder.",
          "input_schema": {"type": "object", "properties": {"topic": {"type": "string"}},
                           "required": ["topic"]}}
_WORDS = ("harbour ferry timetable winter storm bridge tunnel cargo freight crane dock pier "
          "lighthouse tide current channel buoy anchor vessel captain crew manifest").split()


def document(turn: int, words: int = 380) -> str:
    """A made-up ~500-token document, different for every turn."""
    return " ".join(_WORDS[(turn * 7 + i * (turn + 3)) % len(_WORDS)] for i in range(words))


def _turn_record(turn: int, prompt: int, cached: int, output: int, ttft: float,
                 previous: dict | None) -> dict:
    record = {"turn": turn, "prompt_tokens": prompt, "cached_tokens": cached,
              "output_tokens": output, "ttft_s": round(ttft, 4)}
    if previous is not None:
        computed = previous["prompt_tokens"] + previous["output_tokens"]
        record["reuse_of_previous_turn"] = round(min(cached, computed) / computed, 4)
    return record


def anthropic_loop(base_url: str, model: str, max_context: int, output_tokens: int) -> list:
    import anthropic

    client = anthropic.Anthropic(base_url=base_url, api_key="none", max_retries=0, timeout=300)
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Summarise the research folder on the harbour, document by "
                                    "document."}]
    turns: list[dict] = []
    while not turns or turns[-1]["prompt_tokens"] < max_context - 700:
        start = time.perf_counter()
        ttft = None
        with client.messages.stream(model=model, max_tokens=output_tokens, system=system,
                                    tools=[LOOKUP], messages=messages,
                                    extra_body={"temperature": 0.0}) as stream:
            for event in stream:
                if ttft is None and event.type in ("content_block_start", "text"):
                    ttft = time.perf_counter() - start
            final = stream.get_final_message()
        usage = final.usage
        prompt = (usage.input_tokens + usage.cache_read_input_tokens
                  + usage.cache_creation_input_tokens)
        turns.append(_turn_record(len(turns) + 1, prompt, usage.cache_read_input_tokens,
                                  usage.output_tokens, ttft or 0.0,
                                  turns[-1] if turns else None))
        content = [block.model_dump(exclude_none=True) for block in final.content]
        calls = [block for block in final.content if block.type == "tool_use"]
        if not calls:  # the model answered in text: the client asks for the next document
            call_id = f"toolu_{len(turns)}"
            content.append({"type": "tool_use", "id": call_id, "name": "lookup",
                            "input": {"topic": "next"}})
        else:
            call_id = calls[0].id
        messages.append({"role": "assistant", "content": content})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call_id, "content": document(len(turns))}]})
    return turns


def responses_loop(base_url: str, model: str, max_context: int, output_tokens: int) -> list:
    from openai import OpenAI

    client = OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=300)
    turns: list[dict] = []
    previous_id = None
    while not turns or turns[-1]["prompt_tokens"] < max_context - 700:
        start = time.perf_counter()
        ttft, final = None, None
        stream = client.responses.create(
            model=model, instructions=SYSTEM, previous_response_id=previous_id,
            input=f"Document {len(turns) + 1}:\n{document(len(turns) + 100)}\nSummarise it.",
            max_output_tokens=output_tokens, temperature=0, stream=True)
        for event in stream:
            if ttft is None and event.type == "response.output_text.delta":
                ttft = time.perf_counter() - start
            if event.type == "response.completed":
                final = event.response
        assert final is not None and final.usage is not None
        usage = final.usage
        turns.append(_turn_record(len(turns) + 1, usage.input_tokens,
                                  usage.input_tokens_details.cached_tokens, usage.output_tokens,
                                  ttft or 0.0, turns[-1] if turns else None))
        previous_id = final.id
    return turns


def _summary(turns: list[dict]) -> dict:
    later = turns[1:]
    return {"turns": len(turns), "final_prompt_tokens": turns[-1]["prompt_tokens"],
            "min_reuse_turn2_on": min(t["reuse_of_previous_turn"] for t in later),
            "ttft_turn2_s": later[0]["ttft_s"], "ttft_last_s": later[-1]["ttft_s"],
            "ttft_turn2_on_max_s": max(t["ttft_s"] for t in later)}


ENGINES = ("kvmemo", "kvmemo-dense", "vllm")


def engine_server(engine: str, port: int) -> tuple[list[str], str, dict[str, str] | None]:
    """(command, served model name, environment or None) of one engine's server."""
    if engine == "vllm":
        command, name = server_command("vllm", "float32", port)
        command += ["--enable-prefix-caching", "--enable-prompt-tokens-details",
                    "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                    "--chat-template", str(PEERS / "chatml_tools.jinja")]
        return command, name, {**engine_env("vllm"), "VLLM_ENABLE_RESPONSES_API_STORE": "1"}
    command = [sys.executable, "-m", "kvmemo.cli", "serve", "--port", str(port),
               "--served-model-name", "kvmemo-smollm2", "--max-model-len", "8192"]
    if engine == "kvmemo-dense":
        command += ["--weights", "dense", "--dtype", "float32"]
        return command, "kvmemo-smollm2", None
    # The default mode: the benchmarks package makes `auto` dense for its side-by-side figures
    # (benchmarks/__init__.py); this engine is the default mode, native weights in fp32. (Until
    # 2026-11-29 it inherited that and ran dense, as kvmemo-dense does.)
    return command, "kvmemo-smollm2", {**os.environ, "KVMEMO_WEIGHTS": "native",
                                       "KVMEMO_DTYPE": "float32"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-context", type=int, default=8000)
    parser.add_argument("--output-tokens", type=int, default=24)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--engines", default="kvmemo",
                        help=f"comma-separated, run in this order: {', '.join(ENGINES)}")
    args = parser.parse_args(argv)
    engines = args.engines.split(",")
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        parser.error(f"--engines: unknown {unknown}; allowed: {', '.join(ENGINES)}")
    result: dict[str, Any] = {"machine": cpu_label(), "max_context": args.max_context}
    for engine in engines:
        port = args.port or _free_port()
        command, name, env = engine_server(engine, port)
        with running_server(command, port, env, timeout_s=600) as url:
            for api, loop in (("anthropic_messages", anthropic_loop),
                              ("openai_responses", responses_loop)):
                turns = loop(url, name, args.max_context, args.output_tokens)
                # The default engine keeps the file's earlier keys; the others are prefixed.
                key = api if engine == "kvmemo" else f"{engine}/{api}"
                result[key] = {**_summary(turns), "per_turn": turns}
                print(key, json.dumps(turns[-1]), json.dumps(_summary(turns)), flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "agent_api_loop.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
