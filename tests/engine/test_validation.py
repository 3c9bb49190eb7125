"""Bad input raises ValueError naming the field and what is allowed; the CLI exits cleanly."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvmemo import EngineConfig, SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, "top_k must be an integer >= 0"),
        ({"n": 0}, "n must be an integer >= 1"),
    ],
)
def test_sampling_params_errors_name_field_and_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_engine_config_rejects_unknown_and_bad_options():
    with pytest.raises(ValueError, match=r"unknown engine option\(s\) \['blok_size'\]"):
        EngineConfig.from_kwargs(blok_size=16)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int3")
    with pytest.raises(ValueError, match="kv_cache_memory must be a size"):
        EngineConfig(kv_cache_memory="lots")


@pytest.mark.model
def test_empty_and_too_long_prompts(llm):
    with pytest.raises(ValueError, match="prompt must be a non-empty"):
        llm.generate("", use_tqdm=False)
    with pytest.raises(ValueError, match="prompt must be a non-empty"):
        llm.generate([[]], use_tqdm=False)
    too_long = [1] * (llm.engine.max_model_len + 5)
    with pytest.raises(ValueError, match="the model's context is"):
        llm.generate([too_long], use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt token ids must be integers in \[0, 49152\)"):
        llm.generate([[5, 10**9]], use_tqdm=False)


@pytest.mark.model
def test_a_batch_of_texts_encodes_as_each_text_alone(llm):
    processor = llm.engine.processor
    texts = ["Hello, world!", "  leading spaces", "<|im_start|>user\nhi<|im_end|>", "naïve café 🙂",
             "x" * 3000]
    for special in (True, False):
        assert processor.encode_texts(texts, add_special_tokens=special) == [
            processor.encode_prompt(t, add_special_tokens=special) for t in texts]
    with pytest.raises(ValueError, match="prompt must be a non-empty"):
        processor.encode_texts(["fine", ""])


@pytest.mark.model
def test_cli_prints_clear_error_without_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "kvmemo.cli", "generate", "Hi", "--temperature", "-1"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2
    assert "error: temperature must be >= 0" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.model
def test_cli_generate_json():
    import json

    proc = subprocess.run(
        [sys.executable, "-m", "kvmemo.cli", "generate", "The capital of France is", "--max-tokens", "5", "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert len(result["token_ids"]) <= 5 and result["text"]
    assert result["prompt_tokens"] > 0
    # a first prompt in a fresh process: nothing cached, every token a miss with its cause
    causes = result["uncached_prompt_tokens_by_cause"]
    assert sum(causes.values()) == result["prompt_tokens"] - result["cached_prompt_tokens"]
    assert set(causes) <= {"never_seen", "partial_tail"}


@pytest.mark.model
def test_cli_verbose_generate_prints_its_memory():
    import re

    proc = subprocess.run(
        [sys.executable, "-m", "kvmemo.cli", "generate", "Hi", "--max-tokens", "2", "--verbose",
         "--kv-cache-memory", "64MiB"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    line = re.search(r"memory: weights (\d+) MiB, KV pool (\d+) MiB .*peak RSS (\d+) MiB", proc.stderr)
    assert line, proc.stderr
    weights, pool, peak = map(int, line.groups())
    # SmolLM2-135M in fp32 is ~514 MiB of parameters (a packed copy may sit beside the head).
    assert 400 < weights < 1200 and 60 <= pool <= 64 and peak > weights


@pytest.mark.model
def test_cli_chat_keeps_the_conversation_and_reuses_its_kv():
    import re

    proc = subprocess.run(
        [sys.executable, "-m", "kvmemo.cli", "chat", "--max-tokens", "20", "--system", "Answer briefly."],
        input="What is 2 + 2?\nAnd 3 + 3?\n/exit\n",
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("assistant>") == 2
    stats = [tuple(map(int, m)) for m in re.findall(r"\[(\d+) prompt tokens, (\d+) cached", proc.stderr)]
    assert len(stats) == 2
    (first_prompt, _), (second_prompt, second_cached) = stats
    assert second_prompt > first_prompt  # the second turn carries the first
    assert second_cached >= first_prompt - 16  # ... and reuses its KV (up to a partial block)
