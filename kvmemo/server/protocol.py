"""OpenAI-compatible request and response models (completions, chat completions, models).

Invariant: every field a request may carry is declared here. Unknown fields are rejected, and
known OpenAI fields that kvmemo does not implement are accepted only at their neutral value,
so no field that would change the result is ever silently ignored.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvmemo.errors import InputError
from kvmemo.structured.params import StructuredOutputsParams

MAX_N = 16  # samples per request
MAX_LOGPROBS = 20

# OpenAI fields kvmemo does not implement, with the value that means "off".
UNSUPPORTED_NEUTRAL: dict[str, Any] = {
    "best_of": 1,
    # vLLM's, not implemented: beam search over HTTP (offline: LLM.beam_search), custom logits
    # processors, a custom whitespace pattern, structural tags
    "use_beam_search": False,
    "logits_processors": None,
    "guided_whitespace_pattern": None,
    "suffix": None,
    "functions": [],
    "function_call": "none",
    "service_tier": None,
    "store": False,
    "metadata": None,
    "prediction": None,
    "modalities": ["text"],
    "audio": None,
    "reasoning_effort": None,
    "web_search_options": None,
}


def check_unsupported(extra_fields: dict[str, Any]) -> list[str]:
    """The unknown fields, to be ignored (as vLLM ignores them: clients send extras for other
    servers). Raises UnsupportedFieldError for a known OpenAI field set to a value kvmemo does
    not implement: ignoring that would silently change what the client asked for."""
    unknown = []
    for name, value in extra_fields.items():
        if name in UNSUPPORTED_NEUTRAL:
            neutral = UNSUPPORTED_NEUTRAL[name]
            if value is None or value == neutral or value == {} or value == []:
                continue
            raise UnsupportedFieldError(
                name, f"{name} is not supported by this server (only {neutral!r})"
            )
        unknown.append(name)
    return unknown


class UnsupportedFieldError(InputError):
    """A field kvmemo does not implement, or not at this value (`param` names it): a 400."""


_Float = Field(default=None, allow_inf_nan=False)


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # output always follows the schema, strict or not


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` object: one of json, json_object, regex, choice, grammar."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # vLLM's backend options. kvmemo has one backend, writes JSON without free whitespace and,
    # unless a schema says otherwise, without additional properties: these change nothing.
    disable_fallback: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None

    def constraint(self) -> StructuredOutputsParams:
        """The one constraint this object sets (the backend options left out)."""
        return StructuredOutputsParams(
            json=self.json_, json_object=bool(self.json_object), regex=self.regex,
            choice=self.choice, grammar=self.grammar,
        )


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    # vLLM's: every chunk carries the usage so far (guidellm asks for it)
    continuous_usage_stats: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by both routes. Sampling ranges are checked by SamplingParams (-> 400)."""

    model_config = ConfigDict(extra="allow")  # extras are checked against UNSUPPORTED_NEUTRAL

    model: str | None = None
    temperature: float | None = Field(default=None, allow_inf_nan=False)
    top_p: float | None = Field(default=None, allow_inf_nan=False)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored: it does not change results
    # kvmemo / vLLM extras
    cache_salt: str | None = Field(
        default=None, min_length=1, description="isolates tenants' prefix caches"
    )
    top_k: int | None = Field(default=None, ge=0, le=2**31 - 1)
    min_p: float | None = Field(default=None, ge=0, le=1, allow_inf_nan=False)
    ignore_eos: bool = False
    # Penalties and biases (OpenAI's and vLLM's names); SamplingParams checks the ranges.
    presence_penalty: float | None = Field(default=None, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, allow_inf_nan=False)
    repetition_penalty: float | None = Field(default=None, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None  # token id (a string, as JSON keys are) -> bias
    min_tokens: int = Field(default=0, ge=0)
    bad_words: list[str] | None = None  # vLLM: words the output never contains
    # vLLM: keep only the prompt's last this many tokens (-1: as many as the context allows)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    # vLLM: logprobs name tokens "token_id:<id>" (for tokens that are not valid UTF-8 alone)
    return_tokens_as_token_ids: bool = False
    # vLLM: priority (lower is more important). Scheduling stays first-come-first-served, as
    # under vLLM's default policy; above 0, the blocks only this request used are evicted
    # before any other when the pool needs room (a batch job's prompts do not push out
    # interactive prefixes). request_id names the response (id "cmpl-<request_id>").
    priority: int = 0
    request_id: str | None = Field(default=None, min_length=1, max_length=128)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, min_length=1)
    # vLLM: logprobs of the prompt's tokens, with this many top alternatives each
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # Structured output: OpenAI's response_format, vLLM's structured_outputs and its older
    # guided_* names; at most one of them may constrain a request (structured_outputs()).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted and ignored: kvmemo has one backend
    # Chunk KV reuse for segmented prompts (kvmemo/intake/segments.py, docs/blending.md):
    # "blend" reuses each chunk's cached KV at any position; None: the server's default.
    kv_reuse: Literal["prefix", "blend"] | None = None
    recompute_ratio: float | None = Field(default=None, ge=0, le=1, allow_inf_nan=False)

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one constraint the request sets, or None; InputError if it sets several."""
        found: list[tuple[str, StructuredOutputsParams]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise InputError(
                    "response_format", "response_format of type json_schema needs json_schema"
                )
            found.append(("response_format", StructuredOutputsParams(json=rf.json_schema.schema_)))
        if self.structured_outputs is not None:
            found.append(("structured_outputs", self.structured_outputs.constraint()))
        for name, kind in (
            ("guided_json", "json"), ("guided_regex", "regex"),
            ("guided_choice", "choice"), ("guided_grammar", "grammar"),
        ):
            value = getattr(self, name)
            if value is not None:
                found.append((name, StructuredOutputsParams(**{kind: value})))
        if len(found) > 1:
            names = ", ".join(name for name, _ in found)
            raise InputError(found[1][0], f"set one structured output constraint, got {names}")
        return found[0][1] if found else None

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self


class CompletionRequest(_SamplingFields):
    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[int], Field(min_length=1)]
        | list[str]
        | list[list[int]]
        | None
    ) = None
    # kvmemo: the prompt as [context, chunk, ..., question] (text or token ids), instead of
    # prompt; checked by the intake (400 naming the segment)
    segments: list[Any] | None = None
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # the prompt comes back before the completion (with logprobs: its own)
    add_special_tokens: bool = True  # vLLM: the tokenizer's special tokens on a text prompt

    @model_validator(mode="after")
    def _prompt_or_segments(self):
        if (self.prompt is None) == (self.segments is None):
            raise ValueError("give exactly one of prompt and segments")
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ImagePart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["image_url", "input_image", "image"]


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str  # JSON text


class ToolCallItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Required, but null only means "" (an assistant turn that only calls tools); absent is
    # allowed for such a turn too.
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None  # accepted: a participant's name (not rendered)
    tool_calls: list[ToolCallItem] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers

    @model_validator(mode="after")
    def _content_or_calls(self):
        if "content" not in self.model_fields_set and not self.tool_calls:
            raise ValueError("content is required (it may be null on a turn with tool_calls)")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        return self


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # vLLM's chat extras
    echo: bool = False  # the reply starts with the last message's content, if the assistant's
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = Field(default=None, min_length=1)  # Jinja, for this request
    # Tool calling (kvmemo.tool_calls): OpenAI's fields; checked there (400 naming the field)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # kvmemo: retrieved documents, placed at the end of the system message as segments
    # (each a reusable chunk under kv_reuse="blend"); checked by the intake
    documents: list[Any] | None = None


# ---- responses ----------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    # kvmemo, kv_reuse="blend" only: tokens whose KV came from cached chunks, and computed
    blended_tokens: int | None = None
    recomputed_tokens: int | None = None
    # kvmemo: why the other prompt tokens were computed (kvmemo/kv/miss_causes.py)
    uncached_tokens_by_cause: dict[str, int] | None = None
    diverged_at_token: int | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvmemo"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
