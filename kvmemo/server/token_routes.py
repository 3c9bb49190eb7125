"""The tokenizer routes tools call (vLLM's shapes): POST /tokenize, POST /detokenize, and
GET /version.

Invariant: the tokenizer runs on the engine thread (engine.call), as everywhere else: it is not
safe to share across threads. Both POST routes need the API key when one is set.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from kvmemo.errors import InputError
from kvmemo.intake.chat_options import ChatOptions
from kvmemo.intake.prompt_input import PromptInput
from kvmemo.intake.tools import ChatTools, render_tools
from kvmemo.server.chat_input import chat_options, chat_tools, engine_messages
from kvmemo.server.chat_input import engine_message as _engine_message
from kvmemo.server.protocol import ChatCompletionRequest, ChatMessage
from kvmemo.server.serving_common import check_model

if TYPE_CHECKING:
    from kvmemo.engine import AsyncEngine, Engine


class TokenizeRequest(BaseModel):
    """Exactly one of prompt (text) and messages (rendered with the chat template)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # The tokenizer's special tokens (default: true for a prompt, false for messages, whose
    # template writes its own); the chat options are the chat route's.
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    # Rendered as the chat route renders them (intake.tools): the same prompt tokens.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=0)]


def render_chat(engine: Engine, messages: list[dict[str, Any]], options: ChatOptions,
                tools: ChatTools) -> list[int]:
    """A chat's prompt token ids as the chat route computes them (tools rendered by intake.tools).
    On the engine thread."""
    rendering = render_tools(messages, options, tools, engine.processor.template_for(options))
    inputs = PromptInput(messages=rendering.messages, chat_options=rendering.options)
    return engine.processor.process(inputs).token_ids


async def chat_token_ids(engine: AsyncEngine, body: ChatCompletionRequest) -> list[int]:
    """The prompt token ids the chat route would compute for `body`."""
    messages, options, tools = engine_messages(body), chat_options(body), chat_tools(body)
    return await engine.call(lambda e: render_chat(e, messages, options, tools))


async def chat_token_ids_each(
    engine: AsyncEngine, bodies: list[ChatCompletionRequest | None]
) -> list[list[int] | None]:
    """chat_token_ids of each body in one trip to the engine thread; None for a None body and
    for one whose rendering fails (a cut conversation a template refuses)."""
    jobs = [None if b is None else (engine_messages(b), chat_options(b), chat_tools(b))
            for b in bodies]

    def run(e: Engine) -> list[list[int] | None]:
        out: list[list[int] | None] = []
        for job in jobs:
            try:
                out.append(None if job is None else render_chat(e, *job))
            except Exception:  # noqa: BLE001 -- any template error: this cut has no tokens
                out.append(None)
        return out

    return await engine.call(run)


def add_token_routes(
    app: FastAPI, engine: AsyncEngine, model_name: str, auth: list[Any]
) -> None:
    @app.post("/tokenize", dependencies=auth)
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_model(body.model, model_name)
        if (body.prompt is None) == (body.messages is None):
            raise InputError("prompt", "give exactly one of prompt and messages")

        def run(e: Engine) -> list[int]:
            special = body.add_special_tokens
            if body.prompt is not None:
                inputs = PromptInput(prompt=body.prompt, add_special_tokens=special is not False)
                return e.processor.process(inputs).token_ids
            options = ChatOptions(
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                add_special_tokens=bool(special),
                template_kwargs=body.chat_template_kwargs,
                chat_template=body.chat_template,
            )
            messages = [_engine_message(i, m) for i, m in enumerate(body.messages or [])]
            tools = ChatTools(body.tools, body.tool_choice,
                              parallel_tool_calls=body.parallel_tool_calls is not False)
            return render_chat(e, messages, options, tools)

        tokens = await engine.call(run)
        return {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens,
                "token_strs": None}

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        check_model(body.model, model_name)

        def run(e: Engine) -> str:
            vocab = e.processor.vocab_size
            bad = [t for t in body.tokens if t >= vocab]
            if bad:
                raise InputError("tokens", f"token ids must be in [0, {vocab}), got {bad[0]}")
            return e.processor.tokenizer.decode(body.tokens)

        return {"prompt": await engine.call(run)}

    @app.get("/version")
    async def server_version() -> dict[str, str]:
        try:
            return {"version": version("kvmemo")}
        except PackageNotFoundError:  # run from a source tree that was never installed
            return {"version": "unknown"}
