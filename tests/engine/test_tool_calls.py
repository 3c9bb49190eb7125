"""Tool calling offline (LLM.chat with tools) on the real model, and the parts underneath:
the fallback rendering, the reply parser, the checks on tools and histories."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvmemo import SamplingParams
from kvmemo.errors import InputError
from kvmemo.intake.processor import ChatOptions
from kvmemo.tool_calls import parse_reply, parse_tools, tools_for_request
from kvmemo.tool_calls.render import FALLBACK, HERMES, template_takes_tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 30},
        "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather in Oslo, in Celsius?"}]


@pytest.mark.model
def test_required_and_named_choices_always_give_valid_calls(llm):
    """Ten seeded samples per choice, each batch in one call (a seeded request samples the same
    alone or batched, tests/engine/test_sampling.py)."""
    for choice, parallel in (("required", False),
                             ({"type": "function", "function": {"name": "add"}}, True)):
        params = [SamplingParams(max_tokens=80, temperature=1.0, seed=seed) for seed in range(10)]
        outs = llm.chat([QUESTION] * 10, params, tools=TOOLS, tool_choice=choice,
                        parallel_tool_calls=parallel, use_tqdm=False)
        for out in (o.outputs[0] for o in outs):
            assert out.finish_reason == "tool_calls", out.text
            assert len(out.tool_calls) == 1
            function = out.tool_calls[0]["function"]
            if isinstance(choice, dict):
                assert function["name"] == "add"
            jsonschema.validate(json.loads(function["arguments"]), SCHEMAS[function["name"]])
            assert out.tool_calls[0]["id"].startswith("call_")


@pytest.mark.model
def test_next_turn_starts_with_this_turns_prompt_and_answer(llm):
    """The agent-loop property: turn 2's prompt tokens begin with turn 1's prompt and reply
    tokens (the reply as generated, EOS included), so every earlier block is a cache hit."""
    turn1 = llm.chat(QUESTION, SamplingParams(max_tokens=80, temperature=0.8, seed=5),
                     tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                     use_tqdm=False)[0]
    call = turn1.outputs[0].tool_calls[0]
    history = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "4 C, light rain"},
    ]
    prompt = tools_for_request(history, TOOLS, "auto",
                               template=llm.processor.chat_template)
    turn2 = llm.processor.process_chat(prompt.messages)
    sent = turn1.prompt_token_ids + turn1.outputs[0].token_ids
    assert turn2.token_ids[: len(sent)] == sent
    out = llm.chat(history, SamplingParams(max_tokens=8), tools=TOOLS, use_tqdm=False)[0]
    assert out.metrics.num_cached_tokens >= len(sent) - 1


def test_fallback_rendering_is_stable_and_documented_shape():
    history = QUESTION + [
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {
             "name": "get_weather", "arguments": '{"city": "Oslo",  "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4 C"},
    ]
    prompt = tools_for_request(history, TOOLS, None, template=None)
    assert prompt.reply_format == FALLBACK and prompt.choice.mode == "auto"
    system, user, assistant, tool = prompt.messages
    assert system["role"] == "system" and system["content"].startswith("# Tools")
    assert '"name": "get_weather"' in system["content"]
    # The arguments come back verbatim (double space and all): what the model wrote.
    assert assistant["content"] == (
        '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo",  "unit": "C"}}]}'
    )
    assert tool == {"role": "user", "content": "Result of get_weather (call call_1):\n4 C"}
    again = tools_for_request(history, TOOLS, None, template=None)
    assert again.messages == prompt.messages


@pytest.mark.parametrize(
    ("text", "calls", "content"),
    [
        ('{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]}',
         [("add", '{"a": 1, "b": 2}')], None),
        (' {\n "tool_calls" : [ {"name":"add","arguments":{"a":1,"b":2}} ,\n'
         '{"name": "get_weather", "arguments": {"city": "X", "unit": "F"}}]}\n',
         [("add", '{"a":1,"b":2}'), ("get_weather", '{"city": "X", "unit": "F"}')], None),
        ('Let me check.\n{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]}',
         [("add", '{"a": 1, "b": 2}')], "Let me check."),
        ('{"tool_calls": [{"name": "nope", "arguments": {}}]}', [], "same"),
        ('{"tool_calls": [{"name": "add", "arguments": {"a": 1', [], "same"),
        ('{"tool_calls": [{"name": "add", "arguments": "1"}]}', [], "same"),
        ("Plain text answer.", [], "same"),
    ],
)
def test_fallback_parser(text, calls, content):
    reply = parse_reply(text, parse_tools(TOOLS), FALLBACK)
    assert [(c.name, c.arguments) for c in reply.tool_calls] == calls
    assert reply.content == (text if content == "same" else content)


def test_hermes_parser():
    tools = parse_tools(TOOLS)
    text = ('Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\", '
            '\\"unit\\": \\"C\\"}"}</tool_call>')
    reply = parse_reply(text, tools, HERMES)
    assert reply.content == "Sure."
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [
        ("add", {"a": 2, "b": 3}), ("get_weather", {"city": "Rome", "unit": "C"})]
    broken = "<tool_call>{not json}</tool_call>"
    assert parse_reply(broken, tools, HERMES).content == broken


@pytest.mark.model
def test_a_template_that_takes_tools_gets_them(llm):
    template = (
        "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>"
        "{% endif %}{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function.name }}"
        "{{ c.function.arguments | tojson }}</tool_call>{% endfor %}{% endif %}"
        "{% endfor %}<assistant>"
    )
    assert template_takes_tools(template) and not template_takes_tools(llm.processor.chat_template)
    history = QUESTION + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ]
    prompt = tools_for_request(history, TOOLS, None, template=template)
    assert prompt.reply_format == HERMES and prompt.template_tools is not None
    options = ChatOptions(chat_template=template, tools=prompt.template_tools)
    text = llm.processor.render_chat(prompt.messages, options)
    assert text.startswith("<tools>get_weather;add;</tools><user>What is")
    assert '<tool_call>add{"a": 1, "b": 2}</tool_call><tool>3<assistant>' in text


@pytest.mark.parametrize(
    ("tools", "choice", "history", "param", "words"),
    [
        ([{"type": "function", "function": {"name": "bad name!"}}], None, [], "tools", "match"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
         None, [], "tools", "not a JSON schema type"),
        ([WEATHER, WEATHER], None, [], "tools", "second tool"),
        (TOOLS, {"type": "function", "function": {"name": "missing"}}, [], "tool_choice",
         "not a tool"),
        (TOOLS, "sometimes", [], "tool_choice", "must be none, auto, required"),
        (None, "required", [], "tool_choice", "needs tools"),
        (TOOLS, None, [{"role": "tool", "tool_call_id": "call_x", "content": "1"}], "messages",
         "answers no earlier tool call"),
    ],
)
def test_bad_tools_name_the_field(tools, choice, history, param, words):
    with pytest.raises(InputError, match=words) as info:
        tools_for_request(QUESTION + history, tools, choice, template=None)
    assert info.value.param == param


@pytest.mark.model
def test_engine_chat_template_replaces_the_models():
    from kvmemo import LLM

    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "
    llm = LLM(num_blocks=32, chat_template=template)
    prompt = llm.processor.process_chat([{"role": "user", "content": "hi"}])
    assert prompt.text == "[user] hi\n[assistant] "
    assert llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2),
                    use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.model
def test_generated_reply_ids_are_kept_per_cache_salt(llm):
    """A reply's generated ids come back only for the tenant (cache_salt) it was generated for:
    whether a text is known changes how a prompt tokenizes, which must not leak across."""
    params = SamplingParams(max_tokens=80, temperature=0.9, seed=21)
    turn1 = llm.chat(QUESTION, params, tools=TOOLS, tool_choice="required",
                     parallel_tool_calls=False, use_tqdm=False, cache_salt="tenant-a")[0]
    call = turn1.outputs[0].tool_calls[0]
    history = QUESTION + [{"role": "assistant", "content": None, "tool_calls": [call]},
                          {"role": "user", "content": "Thanks."}]
    messages = tools_for_request(history, TOOLS, template=llm.processor.chat_template).messages
    same = llm.processor.process_chat(messages, cache_salt="tenant-a").token_ids
    other = llm.processor.process_chat(messages, cache_salt="tenant-b").token_ids
    text = llm.processor.render_chat(messages)
    plain = llm.tokenizer(text, add_special_tokens=False)["input_ids"]
    sent = turn1.prompt_token_ids + turn1.outputs[0].token_ids
    assert same[: len(sent)] == sent
    assert same != plain  # the generated ids differ from a re-tokenization (else no test)
    assert other == plain  # tenant b sees the ordinary tokenization
    assert llm.tokenizer.decode(same) == llm.tokenizer.decode(other) == text


@pytest.mark.model
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_llm_chat_refuses_a_tool_choice_beside_another_constraint_as_the_server_does(llm, choice):
    """One conflict rule everywhere (intake.tools.constrain_reply): LLM.chat used to replace the
    caller's structured output silently; the server refused. Both refuse now, naming the field."""
    from kvmemo.structured import StructuredOutputsParams

    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
        choice=["yes", "no"]))
    with pytest.raises(InputError, match="constrains the reply itself") as info:
        llm.chat(QUESTION, params, tools=TOOLS, tool_choice=choice, use_tqdm=False)
    assert info.value.param == "tool_choice"
    auto = llm.chat(QUESTION, params, tools=TOOLS, tool_choice="auto", use_tqdm=False)
    assert auto[0].outputs[0].text in ("yes", "no")  # auto leaves the caller's constraint
