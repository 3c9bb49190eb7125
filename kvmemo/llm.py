"""LLM: the offline API. A thin facade holding an Engine: generate() and chat() run a batch to
completion with continuous batching and return outputs in input order.

Invariant: outputs[i] answers prompts[i]; n samples of one prompt come back in one RequestOutput.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal, cast

from tqdm.auto import tqdm

from kvmemo.config import EngineConfig
from kvmemo.engine import BeamSearchParams, Engine, EngineStats, MemoryStats
from kvmemo.intake.processor import ChatOptions, InputProcessor, ProcessedPrompt
from kvmemo.intake.prompt_input import PromptInput
from kvmemo.intake.tools import ChatTools, constrain_reply, render_tools
from kvmemo.outputs import CompletionOutput, RequestOutput, RequestOutputKind
from kvmemo.sampling import SamplingParams
from kvmemo.tool_calls import ToolPrompt, parse_reply

Prompt = str | list[int] | dict[str, Any] | ProcessedPrompt
Conversation = list[dict[str, Any]]


class LLM:
    """Owns one Engine. `LLM(model=None, **engine_options)`; unknown options raise ValueError."""

    def __init__(self, model: str | None = None, **engine_options: Any):
        self.config = EngineConfig.from_kwargs(model=model, **engine_options)
        self.engine = Engine(self.config)
        self._batch_ids = 0

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer. For a GGUF model, a FastTokenizer: Hugging Face's methods the
        engine uses, run in Rust without transformers (start-up), the rest of its API from the
        Hugging Face tokenizer (`.hf`), loaded on first use."""
        return self.engine.tokenizer

    @property
    def processor(self) -> InputProcessor:
        """The intake step: prompts, conversations and images -> ProcessedPrompts."""
        return self.engine.processor

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Generate for one prompt or many: strings, token-id lists, vLLM's
        {"prompt_token_ids": [...]}, or (multimodal models)
        {"prompt": "USER: <image>\\nWhat is this?", "images": [PIL image | path | bytes, ...]}."""
        processed = [self.processor.process_any(p) for p in _as_prompt_list(prompts)]
        return self._run(processed, sampling_params, use_tqdm, cache_salt)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        cache_salt: str | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        chat_options: ChatOptions | None = None,
        documents: Sequence[str] | Sequence[Sequence[str]] | None = None,
        kv_reuse: str | None = None,
        recompute_ratio: float | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of {'role', 'content'} dicts) or a list of them.

        A content may be a list of OpenAI parts: {"type": "text", "text": ...} and, for
        multimodal models, {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}
        or {"type": "image", "image": PIL image | path | bytes}.

        tools, tool_choice, parallel_tool_calls: OpenAI's, rendered and enforced as the server
        does (docs/server.md, "Tool calling"); assistant turns may carry `tool_calls` and `tool`
        turns a `tool_call_id`. A reply that calls tools has CompletionOutput.tool_calls (OpenAI
        form) and finish_reason "tool_calls". chat_options: the template and its options.

        documents: retrieved texts placed at the end of the system message, each a segment
        (one list for every conversation, or one list per conversation); with
        kv_reuse="blend" each document's KV is reused wherever it appears (docs/blending.md).
        """
        if isinstance(messages, list) and messages and isinstance(messages[0], dict):
            messages = [messages]
        conversations = list(messages)
        params = _per_prompt_params(sampling_params, len(conversations))
        template = self.processor.template_for(chat_options)
        prompts, tool_prompts = [], []
        per_conversation = (
            documents is not None and len(documents) > 0
            and all(isinstance(d, (list, tuple)) for d in documents)
        )
        if per_conversation and len(documents or ()) != len(conversations):
            raise ValueError(
                f"documents has {len(documents or ())} lists for {len(conversations)} "
                "conversations; give one list per conversation, or one list for all"
            )
        chat_tools = ChatTools(tools, tool_choice, parallel_tool_calls=parallel_tool_calls)
        for i, conversation in enumerate(conversations):
            rendering = render_tools(conversation, chat_options, chat_tools, template)
            params[i] = constrain_reply(params[i], rendering.prompt)
            docs = documents[i] if per_conversation and documents is not None else documents
            inputs = PromptInput(messages=rendering.messages, chat_options=rendering.options,
                                 documents=docs, kv_reuse=kv_reuse,
                                 recompute_ratio=recompute_ratio)
            prompts.append(self.processor.process(inputs, cache_salt))
            tool_prompts.append(rendering.prompt)
        outputs = self._run(prompts, params, use_tqdm, cache_salt)
        for out, tool_prompt in zip(outputs, tool_prompts):
            if tool_prompt is not None and tool_prompt.parses_calls:
                for completion in out.outputs:
                    _read_tool_calls(completion, tool_prompt)
        return outputs

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        beam_width: int = 4,
        max_tokens: int = 16,
        length_penalty: float = 1.0,
        early_stopping: bool | Literal["never"] = False,
        use_tqdm: bool = True,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Beam search for one prompt or many, equal to HF `generate(num_beams=beam_width,
        do_sample=False, max_new_tokens=max_tokens, length_penalty=..., early_stopping=...,
        num_return_sequences=beam_width)`. outputs[i].outputs holds prompt i's beam_width finished
        beams, best score first, each with token_ids (the final EOS included), text,
        cumulative_logprob and score. All prompts' beams run batched, one forward per step."""
        params = BeamSearchParams(beam_width, max_tokens, length_penalty, early_stopping)
        processed = [self.processor.process_any(p) for p in _as_prompt_list(prompts)]
        ids = self._new_ids(len(processed))
        self.engine.add_requests(
            [(rid, prompt, params) for rid, prompt in zip(ids, processed)], cache_salt=cache_salt
        )
        finished = self._wait(ids, "beam search", use_tqdm)
        return [finished[rid] for rid in ids]

    def get_metrics(self) -> EngineStats:
        """Prefix-cache, scheduler, store and encoder counters since start (tokens, blocks, hit
        rate); `.as_dict()` gives them flat by name."""
        return self.engine.stats()

    def memory_stats(self) -> MemoryStats:
        """Weights as held, the KV pool's size and the process's peak RSS, in bytes."""
        return self.engine.memory_stats()

    def reset_prefix_cache(self) -> tuple[bool, str]:
        """Drop every cached block; refused (False, reason) while requests hold blocks."""
        return self.engine.reset_prefix_cache()

    def subscribe_kv_events(self, callback) -> None:
        """Receive BlockStored / BlockRemoved / AllBlocksCleared lists after each step
        (needs LLM(..., enable_kv_events=True))."""
        self.engine.subscribe_kv_events(callback)

    def _new_ids(self, count: int) -> list[str]:
        self._batch_ids += 1
        return [f"b{self._batch_ids}-{i}" for i in range(count)]

    def _run(
        self,
        prompts: list[ProcessedPrompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        cache_salt: str | None,
    ) -> list[RequestOutput]:
        params = _per_prompt_params(sampling_params, len(prompts))
        groups: dict[str, tuple[int, int]] = {}  # sequence id -> (prompt index, sample index)
        batch: list[tuple[str, ProcessedPrompt, SamplingParams]] = []
        prompt_ids = self._new_ids(len(prompts))
        for i, (prompt_id, prompt, p) in enumerate(zip(prompt_ids, prompts, params)):
            for j, sample in enumerate(p.per_sample()):
                rid = f"{prompt_id}-{j}"
                groups[rid] = (i, j)
                # Only the final output is read: no per-token copies of the text and ids.
                final = dataclasses.replace(sample, output_kind=RequestOutputKind.FINAL_ONLY)
                batch.append((rid, prompt, final))
        self.engine.add_requests(batch, cache_salt=cache_salt)
        finished = self._wait(list(groups), "requests", use_tqdm)
        return _group_samples(finished, groups, len(prompts))

    def _wait(self, request_ids: list[str], desc: str, use_tqdm: bool) -> dict[str, RequestOutput]:
        """Steps the engine until every request of `request_ids` finished; their final outputs."""
        wanted = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(wanted), desc=desc, disable=not use_tqdm, unit="req") as bar:
            while len(finished) < len(wanted):
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        finished[out.request_id] = out
                        bar.update(1)
        return finished


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> Sequence[Prompt]:
    """One prompt (a string, a token-id list, an image prompt dict or a ProcessedPrompt)
    becomes a list of one."""
    if isinstance(prompts, (str, dict, ProcessedPrompt)) or (
        isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
    ):
        return [cast(Prompt, prompts)]
    return cast("Sequence[Prompt]", prompts)


def _per_prompt_params(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    if len(sampling_params) != num_prompts:
        raise ValueError(
            f"sampling_params has {len(sampling_params)} entries for {num_prompts} prompts; "
            "pass one SamplingParams or one per prompt"
        )
    return list(sampling_params)


def _group_samples(
    finished: dict[str, RequestOutput], groups: dict[str, tuple[int, int]], num_prompts: int
) -> list[RequestOutput]:
    merged: list[RequestOutput | None] = [None] * num_prompts
    for rid in sorted(groups, key=groups.__getitem__):
        i, j = groups[rid]
        out = finished[rid]
        out.outputs[0].index = j
        first = merged[i]
        if first is None:
            out.request_id = rid.rsplit("-", 1)[0]
            merged[i] = out
        else:
            first.outputs.append(out.outputs[0])
    return [m for m in merged if m is not None]


def _read_tool_calls(completion: CompletionOutput, tool_prompt: ToolPrompt) -> None:
    """A finished reply that calls tools gets them (OpenAI form) and finish_reason
    "tool_calls"; its text stays the model's own."""
    if completion.finish_reason != "stop":
        return
    reply = parse_reply(completion.text, list(tool_prompt.tools), tool_prompt.reply_format)
    if reply.tool_calls:
        completion.tool_calls = [call.as_openai() for call in reply.tool_calls]
        completion.finish_reason = "tool_calls"
