"""FastTokenizer and kvmemo's chat-template renderer against Hugging Face's, on both bundled
GGUFs: the reference is transformers converting the GGUF itself (AutoTokenizer with gguf_file),
never kvmemo's saved copy. Ids, texts, tokens and special tokens must be equal, and every chat
kvmemo renders must be the text `apply_chat_template` renders."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import jinja2
import pytest

from kvmemo.model.loading.chat_template import render_chat_template
from kvmemo.model.loading.fast_tokenizer import FastTokenizer
from kvmemo.model.loading.loader import load_tokenizer

# Tokenizing runs no kernel of kvmemo's: the forced-ISA reruns of tests/model skip it.
pytestmark = [pytest.mark.model, pytest.mark.native_isa_only]

TEXTS = [
    "Hello world!", " leading space", "trailing space ", "A\n\nB  c\t d\r\n", "x" * 300,
    "héllo wörld 日本語 🙂 ∑", "<|im_start|>user\nhi<|im_end|>", "<start_of_turn>user\nhi<end_of_turn>\n",
    "don't  stop ,  here . ok ?", "def f(x):\n    return {'a': [1, 2]}\n", "",
]


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def pair(request, smollm_gguf: Path, gemma3_gguf: Path) -> tuple[Any, Any, str | None]:
    """(kvmemo's tokenizer, transformers' own conversion of the same GGUF, chat template)."""
    from transformers import AutoTokenizer

    gguf = smollm_gguf if request.param == "smollm2" else gemma3_gguf
    ours, template, _ = load_tokenizer(gguf)
    reference = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                              local_files_only=True)
    return ours, reference, template


def test_it_is_the_fast_tokenizer(pair) -> None:
    ours, _, _ = pair
    assert isinstance(ours, FastTokenizer)


def test_encode_equals_hf(pair) -> None:
    ours, hf, _ = pair
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == hf.encode(
                text, add_special_tokens=special), (text, special)
            assert ours(text, add_special_tokens=special).input_ids == hf(
                text, add_special_tokens=special)["input_ids"]
    batch = [t for t in TEXTS if t]
    assert ours(batch)["input_ids"] == hf(batch)["input_ids"]


def test_decode_equals_hf(pair) -> None:
    ours, hf, _ = pair
    rng = random.Random(0)
    added = sorted(hf.added_tokens_decoder)  # every special and added token, whatever the vocab
    ids = added + [rng.randrange(len(hf)) for _ in range(2000)]
    for skip in (True, False):
        for i in ids:
            assert ours.decode([i], skip_special_tokens=skip) == hf.decode(
                [i], skip_special_tokens=skip), (i, skip)
        for _ in range(200):
            seq = [rng.choice(ids) for _ in range(rng.randrange(1, 16))]
            assert ours.decode(seq, skip_special_tokens=skip) == hf.decode(
                seq, skip_special_tokens=skip), seq


def test_the_compact_copy_tokenizes_as_the_original(pair, tmp_path: Path) -> None:
    """The copy with string merges, written on first load and read after, changes no id."""
    import json
    import shutil

    from kvmemo.model.loading.fast_tokenizer import COMPACT_FILE

    ours, hf, _ = pair
    directory = tmp_path / "tok"
    shutil.copytree(ours.directory, directory)
    (directory / COMPACT_FILE).unlink(missing_ok=True)
    first = FastTokenizer(directory)  # from tokenizer.json; writes the copy
    merges = json.loads((directory / COMPACT_FILE).read_text())["model"]["merges"]
    assert merges and all(isinstance(m, str) for m in merges)
    second = FastTokenizer(directory)  # from the copy
    rng = random.Random(1)
    ids = [rng.randrange(len(hf)) for _ in range(300)]
    for text in TEXTS + [hf.decode(ids)]:
        assert first.encode(text) == second.encode(text) == hf.encode(text), text
    assert second.decode(ids) == hf.decode(ids)
    (directory / COMPACT_FILE).write_text("{not json")  # damaged: read from the original again
    assert FastTokenizer(directory).encode(TEXTS[3]) == hf.encode(TEXTS[3])


def test_tensors_and_arrays_of_ids_are_accepted(pair) -> None:
    import numpy as np
    import torch

    ours, hf, _ = pair
    ids = hf.encode("tensors of ids, and arrays")
    for given in (torch.tensor(ids), np.array(ids)):
        assert ours.decode(given) == hf.decode(given)
        assert ours.convert_ids_to_tokens(given) == hf.convert_ids_to_tokens(given)
    assert ours.decode(np.int64(ids[1])) == hf.decode(np.int64(ids[1]))


def test_vocabulary_and_special_tokens_equal_hf(pair) -> None:
    ours, hf, _ = pair
    assert len(ours) == len(hf)
    assert ours.vocab_size == hf.vocab_size
    assert ours.special_tokens_map == hf.special_tokens_map
    assert ours.all_special_ids == hf.all_special_ids
    assert ours.all_special_tokens == hf.all_special_tokens
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "mask_token"):
        assert getattr(ours, name) == getattr(hf, name), name
        assert getattr(ours, name + "_id") == getattr(hf, name + "_id"), name
    for i in [0, 1, 2, 3, 100, len(hf) - 1]:
        token = hf.convert_ids_to_tokens(i)
        assert ours.convert_ids_to_tokens(i) == token
        assert ours.convert_tokens_to_ids(token) == hf.convert_tokens_to_ids(token)
    assert ours.convert_tokens_to_ids("no-such-token-anywhere") == hf.convert_tokens_to_ids(
        "no-such-token-anywhere")
    assert ours.convert_ids_to_tokens([0, 1, 2, 50], skip_special_tokens=True) == (
        hf.convert_ids_to_tokens([0, 1, 2, 50], skip_special_tokens=True))


def test_what_it_leaves_out_comes_from_hf(pair) -> None:
    ours, hf, _ = pair
    assert ours.padding_side == hf.padding_side  # not implemented here: loaded on demand
    assert type(ours.hf).__name__ == type(hf).__name__


def test_added_tokens_agree_with_hf(smollm_gguf: Path) -> None:
    """add_tokens (what a LLaVA checkpoint's <image> needs) changes ids, length and the Hugging
    Face tokenizer behind it alike, whether that one is loaded before or after."""
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(smollm_gguf.parent), gguf_file=smollm_gguf.name,
                                              local_files_only=True)
    assert reference.add_tokens(["<image>"], special_tokens=True) == 1
    assert reference.add_tokens(["zzqword"]) == 1
    text = "look <image> here zzqword"
    for hf_first in (False, True):
        ours, _, _ = load_tokenizer(smollm_gguf)
        ours = FastTokenizer(ours.directory)  # a fresh one: load_tokenizer's is shared by none
        if hf_first:
            assert ours.hf is not None
        assert ours.add_tokens(["<image>"], special_tokens=True) == 1
        assert ours.add_tokens("zzqword") == 1
        assert len(ours) == len(reference) == len(ours.hf)
        assert ours.convert_tokens_to_ids("<image>") == reference.convert_tokens_to_ids("<image>")
        assert ours.encode(text) == reference.encode(text) == ours.hf.encode(text)
        for skip in (True, False):
            ids = reference.encode(text)
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(
                ids, skip_special_tokens=skip)


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city, «now»",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]

# Templates that use what the sandbox provides: tojson with options, namespace, loop controls,
# raise_exception, {% generation %}, tools, documents, reasoning under its other names.
PROBE = """{%- set ns = namespace(n=0) -%}
{%- for m in messages -%}{%- if m.role == 'skip' %}{% continue %}{% endif -%}
{%- set ns.n = ns.n + 1 -%}
<{{ m.role }}:{{ ns.n }}>{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}
{%- else %}{{ m.content if m.content is string else m.content | tojson }}{% endif %}
{%- if m.reasoning_content is defined %}[r={{ m.reasoning_content }}|t={{ m.thinking }}]{% endif %}
{%- if m.tool_calls is defined %}{{ m.tool_calls | tojson(indent=2) }}{% endif %}
{%- if m.name is defined %}(name={{ m.name }}){% endif %}
{% endfor -%}
{%- if tools %}TOOLS {{ tools | tojson(sort_keys=True) }}{% endif -%}
{%- if documents %}DOCS {{ documents | map(attribute='title') | join(',') }}{% endif -%}
  {% if messages | length > 1 %}
    many
  {% endif %}
{{ bos_token }}|{{ eos_token }}|{{ extra | default('-') }}|{{ dict(a=1) | tojson }}
{%- if add_generation_prompt %}<assistant>{% endif -%}"""

CHATS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "Hi there"}], "add_generation_prompt": True},
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "4", "tool_calls": None},
                  {"role": "user", "content": "And 3+3? 日本"}], "add_generation_prompt": True},
    {"messages": [{"role": "user", "content": "Start"},
                  {"role": "assistant", "content": "Once upon a time "}],
     "continue_final_message": True},
    {"messages": [{"role": "user", "content": "Weather?"},
                  {"role": "assistant", "content": "", "tool_calls": [
                      {"type": "function", "function": {"name": "get_weather",
                                                        "arguments": {"city": "Oslo"}}}]},
                  {"role": "tool", "name": "get_weather", "content": "12 C"}],
     "tools": TOOLS, "add_generation_prompt": True},
]


@pytest.mark.parametrize("case", range(len(CHATS)))
def test_bundled_template_renders_as_hf(pair, case: int) -> None:
    ours, hf, template = pair
    chat = CHATS[case]
    if template is None:
        pytest.skip("no chat template")
    kwargs = {k: v for k, v in chat.items() if k != "messages"}
    try:
        expected = hf.apply_chat_template(chat["messages"], chat_template=template,
                                          tokenize=False, **kwargs)
    except (ValueError, jinja2.TemplateError) as e:  # the template refuses: so must we
        with pytest.raises(type(e)):
            ours.apply_chat_template(chat["messages"], tokenize=False, chat_template=template,
                                     **kwargs)
        return
    got = ours.apply_chat_template(chat["messages"], chat_template=template, tokenize=False,
                                   **kwargs)
    assert got == expected
    assert ours.apply_chat_template(chat["messages"], chat_template=template, **kwargs) == (
        hf.encode(expected, add_special_tokens=False))


MORE: list[dict[str, Any]] = [
    *CHATS,
    {"messages": [{"role": "user", "content": "q"}, {"role": "skip", "content": "x"},
                  {"role": "assistant", "content": "a", "thinking": "hmm"}],
     "documents": [{"title": "T1", "text": "one"}, {"title": "T2", "text": "two"}],
     "extra": "E"},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "part"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "so far "}]}],
     "continue_final_message": True},
    {"messages": [{"role": "user", "content": "q"},
                  {"role": "assistant", "content": "a", "reasoning": "why"}],
     "continue_final_message": "reasoning_content"},
]


@pytest.mark.parametrize("case", range(len(MORE)))
def test_probe_template_renders_as_hf(pair, case: int) -> None:
    ours, hf, _ = pair
    chat = MORE[case]
    kwargs = {k: v for k, v in chat.items() if k != "messages"}
    expected = hf.apply_chat_template(chat["messages"], chat_template=PROBE, tokenize=False,
                                      **kwargs)
    assert render_chat_template(PROBE, chat["messages"], special_tokens=ours.special_tokens_map,
                                **kwargs) == expected
    assert chat == MORE[case]  # the caller's messages are untouched


def test_refusals_match_hf(pair) -> None:
    ours, hf, _ = pair
    refusing = "{{ raise_exception('no system role here') }}"
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(jinja2.TemplateError, match="no system role"):
        hf.apply_chat_template(messages, chat_template=refusing, tokenize=False)
    with pytest.raises(jinja2.TemplateError, match="no system role"):
        ours.apply_chat_template(messages, chat_template=refusing, tokenize=False)
    escape = "{% set ns = namespace() %}{% set ns._x = 1 %}"
    with pytest.raises(jinja2.exceptions.SecurityError):
        hf.apply_chat_template(messages, chat_template=escape, tokenize=False)
    with pytest.raises(jinja2.exceptions.SecurityError):
        ours.apply_chat_template(messages, chat_template=escape, tokenize=False)
    with pytest.raises(ValueError):
        ours.apply_chat_template(messages, chat_template="{{ messages }}", tokenize=False,
                                 add_generation_prompt=True, continue_final_message=True)


def test_loading_a_gguf_model_imports_no_transformers(smollm_gguf: Path) -> None:
    """What the start-up saving rests on: engine, tokenizer, a chat and a reply, no
    transformers (once the tokenizer is converted and cached: done here first)."""
    load_tokenizer(smollm_gguf)
    code = (
        "import sys\n"
        "from kvmemo import LLM, SamplingParams\n"
        f"llm = LLM({str(smollm_gguf)!r}, max_model_len=512)\n"
        "out = llm.chat([{'role': 'user', 'content': 'Hi'}], "
        "SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)\n"
        "assert out[0].outputs[0].token_ids, out\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=True)
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout
