"""Every miss explained, through a real `kvmemo serve` and the unmodified openai SDK: usage's
prompt_tokens_details carries the uncached tokens by cause (adding up to the uncached prompt
tokens on every answer), the token where a prompt left a cached conversation, and /metrics
counts causes, another tenant's copy included (which no answer reveals)."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

from tests.server.conftest import launch_server  # noqa: E402

pytestmark = pytest.mark.model

SYSTEM = ("You are the assistant of a bicycle shop. We repair bikes, sell helmets, lights and "
          "locks, and rent city bikes by the day. Answer in one short sentence. ") * 2


@pytest.fixture(scope="module")
def server():
    with launch_server("--num-blocks", "64", "--max-model-len", "1024") as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0,
                         timeout=120)


def _ask(server, client, question: str, salt: str | None = None) -> dict:
    extra = {} if salt is None else {"cache_salt": salt}
    out = client.chat.completions.create(
        model=server.model_name(), max_tokens=1, temperature=0.0, extra_body=extra,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
    usage = out.usage.model_dump()
    details = usage["prompt_tokens_details"]
    causes = details["uncached_tokens_by_cause"]
    assert sum(causes.values()) == usage["prompt_tokens"] - details["cached_tokens"], usage
    return details


def _counter(server, cause: str) -> float:
    import httpx

    name = f'kvmemo_prompt_uncached_tokens{{cause="{cause}"}}'
    lines = httpx.get(server.base_url + "/metrics").text.splitlines()
    return float(next(line.split()[-1] for line in lines if line.startswith(name)))


def test_causes_through_a_conversation(server, client):
    tail = " for city bikes, and do you also repair electric bikes on weekends and holidays?"
    first = _ask(server, client, "Do you sell helmets" + tail)
    assert set(first["uncached_tokens_by_cause"]) <= {"never_seen", "partial_tail", "diverged"}
    again = _ask(server, client, "Do you sell helmets" + tail)
    assert again["uncached_tokens_by_cause"] == {"last_token": 1}
    other = _ask(server, client, "Do you sell locks" + tail)
    causes = other["uncached_tokens_by_cause"]
    assert causes.get("diverged", 0) > 0
    assert other["diverged_at_token"] >= other["cached_tokens"]


def test_another_tenants_copy_is_counted_but_not_told(server, client):
    before = _counter(server, "other_salt")
    _ask(server, client, "Can you fix a flat tyre today?", salt="tenant-a")
    told = _ask(server, client, "Can you fix a flat tyre today?", salt="tenant-b")
    assert "other_salt" not in told["uncached_tokens_by_cause"]
    assert told["uncached_tokens_by_cause"].get("never_seen", 0) >= 64
    assert _counter(server, "other_salt") - before >= 64


def test_a_flooded_conversation_was_evicted(server, client):
    question = "How much is a city bike for a whole week?"
    _ask(server, client, question)
    for i in range(8):  # twice the pool's tokens of one-off prompts
        client.completions.create(model=server.model_name(), max_tokens=1, temperature=0.0,
                                  prompt=f"flood {i}: " + f"[{i}] {SYSTEM}" * 3)
    again = _ask(server, client, question)
    assert again["uncached_tokens_by_cause"].get("evicted", 0) >= 64
    assert _counter(server, "evicted") >= 64


# A ChatML template that drops an assistant's reasoning from the history (as Qwen's does)
DROPS_REASONING = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}{{ m.content.split('</think>')[-1] }}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_drops_reasoning_is_reported_as_drift(server, client):
    """Turn 1 answers with reasoning (forced by a regex); turn 2's history, rendered by a
    template that drops it, leaves the cache at the reply's first token, and usage says so."""
    model = server.model_name()
    history = [{"role": "system", "content": SYSTEM},
               {"role": "user", "content": "Which lock should I buy for a city bike?"}]
    options = {"chat_template": DROPS_REASONING}
    first = client.chat.completions.create(
        model=model, messages=history, max_tokens=80, temperature=0.0,
        extra_body={**options, "structured_outputs": {
            "regex": "<think>[a-z ]{30,60}</think>[A-Za-z ]{10,30}"}})
    reply = first.choices[0].message.content
    assert reply.startswith("<think>") and "</think>" in reply
    second = client.chat.completions.create(
        model=model, max_tokens=1, temperature=0.0, extra_body=options,
        messages=[*history, {"role": "assistant", "content": reply},
                  {"role": "user", "content": "And a helmet?"}])
    details = second.usage.model_dump()["prompt_tokens_details"]
    # at the reply's first token, or the one before it (here the template's newline, which
    # the tokenizer merges with the re-rendered reply's first word)
    reply_start = first.usage.prompt_tokens
    assert details["diverged_at_token"] in (reply_start - 1, reply_start)
    assert details["cached_tokens"] == details["diverged_at_token"]
    assert details["uncached_tokens_by_cause"].get("template_drift", 0) > 0
