"""PromptInput and the intake's one front door, InputProcessor.process: each form (text, ids,
chat, segments) gives what its form-specific path gives, truncation applies to every form, and
an input with no form or two is refused by name."""

from __future__ import annotations

import pytest

from kvmemo.errors import InputError
from kvmemo.intake.chat_options import ChatOptions
from kvmemo.intake.processor import InputProcessor
from kvmemo.intake.prompt_input import PromptInput
from kvmemo.model.loading.loader import load_tokenizer

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def processor() -> InputProcessor:
    tokenizer, template, _ = load_tokenizer(None)  # the bundled model's, no weights
    return InputProcessor(tokenizer, len(tokenizer), template)


def test_every_form_goes_through_the_front_door(processor) -> None:
    text = processor.process(PromptInput(prompt="Hello there"))
    assert text.token_ids == processor.encode_prompt("Hello there") and text.text == "Hello there"
    assert processor.process("Hello there") == text  # a bare prompt is PromptInput(prompt=...)
    assert processor.process(PromptInput(prompt=[5, 6, 7])).token_ids == [5, 6, 7]
    options = ChatOptions(add_generation_prompt=False)
    chat = processor.process(PromptInput(messages=CHAT, chat_options=options))
    assert chat.token_ids == processor.process_chat(CHAT, options).token_ids
    assert chat.token_ids != processor.process(PromptInput(messages=CHAT)).token_ids
    pieces = ["A shared context. ", "A document. ", "The question?"]
    segmented = processor.process(PromptInput(segments=pieces, kv_reuse="blend"))
    assert segmented.token_ids == processor.process_segments(pieces, "blend").token_ids
    assert segmented.segments is not None


@pytest.mark.parametrize("form", [
    PromptInput(prompt="one two three four five six seven"),
    PromptInput(messages=CHAT),
    PromptInput(segments=["one two three ", "four five six seven"]),
])
def test_truncation_keeps_the_last_tokens_of_any_form(processor, form) -> None:
    whole = processor.process(form).token_ids
    kept = processor.process(
        PromptInput(**{**form.__dict__, "truncate_prompt_tokens": 3})).token_ids
    assert kept == whole[-3:]


def test_no_form_or_two_forms_are_refused() -> None:
    with pytest.raises(InputError, match="exactly one of prompt, messages and segments"):
        PromptInput()
    with pytest.raises(InputError, match="got \\['prompt', 'messages'\\]"):
        PromptInput(prompt="a", messages=CHAT)


def test_offline_forms(processor) -> None:
    assert PromptInput.from_offline("hi") == PromptInput(prompt="hi")
    assert PromptInput.from_offline({"segments": ["a", "b"], "kv_reuse": "blend"}) == (
        PromptInput(segments=["a", "b"], kv_reuse="blend"))
    assert PromptInput.from_offline({"prompt_token_ids": [1, 2]}) == PromptInput(prompt=[1, 2])
    with pytest.raises(InputError, match="a token prompt takes the one key 'prompt_token_ids'"):
        PromptInput.from_offline({"prompt_token_ids": [1], "images": []})
    with pytest.raises(InputError, match="a dict prompt takes the keys"):
        PromptInput.from_offline({"text": "hi"})
    with pytest.raises(InputError, match="a segments prompt takes the keys"):
        PromptInput.from_offline({"segments": ["a"], "images": []})
