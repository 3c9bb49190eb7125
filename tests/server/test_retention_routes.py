"""Retention through the agent routes, on a real `kvmemo serve` with a small KV pool, through
the unmodified SDKs: a cache_control breakpoint's prefix (Anthropic) and a prompt_cache_retention
"24h" prompt (OpenAI Responses) survive a flood that evicts an unmarked twin; a breakpoint past
the cache_salt's quota gets a 400 naming the limit; a bad retention value a 400 naming the
field. (Expiry on time is tested on the manager with a clock: tests/kv/test_retention.py.)"""

from __future__ import annotations

import pytest

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

from tests.server.conftest import launch_server  # noqa: E402

pytestmark = pytest.mark.model

BLOCKS = 64  # 16-token blocks: 1,024 tokens, so the flood below evicts all it may
QUOTA = 256  # retained tokens per cache_salt


@pytest.fixture(scope="module")
def server():
    with launch_server("--num-blocks", str(BLOCKS), "--max-model-len", "1024",
                       "--max-retained-tokens", str(QUOTA)) as running:
        yield running


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0,
                               timeout=120)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0,
                         timeout=120)


def _text(tag: str, repeat: int = 3) -> str:
    return (f"[{tag}] You are the assistant of a bicycle shop. We repair bikes, sell helmets, "
            "lights and locks, and rent city bikes by the day. ") * repeat


def _flood(oai, model: str, tag: str) -> None:
    """Twice the pool's tokens of one-off prompts."""
    for i in range(8):
        oai.completions.create(model=model, max_tokens=1, temperature=0.0,
                               prompt=f"{tag} {i}: " + _text(f"{tag}-{i}", 5))


def _metric(server, name: str) -> float:
    import httpx

    lines = httpx.get(server.base_url + "/metrics").text.splitlines()
    return float(next(line.split()[1] for line in lines if line.startswith(name + " ")))


def _ask(claude, model: str, system: str, marked: bool, question: str):
    block: dict = {"type": "text", "text": system}
    if marked:
        block["cache_control"] = {"type": "ephemeral", "ttl": "5m"}
    return claude.messages.create(model=model, max_tokens=2, system=[block],
                                  messages=[{"role": "user", "content": question}],
                                  extra_body={"temperature": 0.0})


def test_a_breakpoint_keeps_its_prefix_through_a_flood(server, claude, oai):
    model = server.model_name()
    marked, unmarked = _text("kept"), _text("twin")
    first = _ask(claude, model, marked, True, "Do you sell helmets?")
    _ask(claude, model, unmarked, False, "Do you sell helmets?")
    assert first.usage.cache_creation_input_tokens >= 96
    assert _metric(server, "kvmemo_retained_blocks") >= 6
    _flood(oai, model, "flood-a")
    kept = _ask(claude, model, marked, True, "Can you fix a flat tyre?")
    lost = _ask(claude, model, unmarked, False, "Can you fix a flat tyre?")
    assert kept.usage.cache_read_input_tokens >= 96  # the system prompt's blocks
    assert lost.usage.cache_read_input_tokens < 16  # the control: evicted by the flood
    assert _metric(server, "kvmemo_retained_evicted_blocks") == 0


def test_a_breakpoint_past_the_quota_is_a_400_naming_the_limit(server, claude):
    long_system = _text("quota", 12)  # ~400 tokens: past the 256-token quota
    with pytest.raises(anthropic.BadRequestError) as error:
        claude.messages.create(
            model=server.model_name(), max_tokens=2,
            system=[{"type": "text", "text": long_system, "cache_control": {"type": "ephemeral"}}],
            messages=[{"role": "user", "content": "Hi"}],
            extra_body={"cache_salt": "tenant-q"})
    message = str(error.value)
    assert f"the limit is {QUOTA} tokens per cache_salt" in message
    assert "'tenant-q'" in message and "--max-retained-tokens" in message


def test_prompt_cache_retention_keeps_the_prompt_through_a_flood(server, oai):
    model = server.model_name()

    def ask(instructions: str, retention: str | None, question: str):
        extra = {} if retention is None else {"prompt_cache_retention": retention}
        return oai.responses.create(model=model, instructions=instructions, input=question,
                                    max_output_tokens=2, temperature=0.0, store=False, **extra)

    kept_text, twin_text = _text("day-kept"), _text("day-twin")
    ask(kept_text, "24h", "Do you rent bikes?")
    ask(twin_text, "in_memory", "Do you rent bikes?")
    _flood(oai, model, "flood-r")
    kept = ask(kept_text, None, "Do you rent bikes?")
    lost = ask(twin_text, None, "Do you rent bikes?")
    assert kept.usage.input_tokens_details.cached_tokens >= 96
    assert lost.usage.input_tokens_details.cached_tokens < 16
    with pytest.raises(openai.BadRequestError) as error:
        ask(kept_text, "forever", "Hi")
    assert "prompt_cache_retention must be 'in_memory' or '24h'" in str(error.value)


def test_a_breakpoint_keeps_only_the_prefix_up_to_its_block(server, claude, oai):
    """A mark on the first user turn of a longer conversation: after a flood, the same
    conversation reads back the prefix up to the marked block (within a block), not beyond."""
    model = server.model_name()
    system = _text("mid", 2)
    marked_turn = {"role": "user", "content": [
        {"type": "text", "text": "First question: " + _text("mid-q", 1),
         "cache_control": {"type": "ephemeral"}}]}
    rest = [{"role": "assistant", "content": "Noted."},
            {"role": "user", "content": "Second question: " + _text("mid-later", 2)}]
    ask = {"model": model, "max_tokens": 2, "system": system,
           "extra_body": {"temperature": 0.0, "cache_salt": "mid"}}
    upto_mark = claude.messages.count_tokens(
        model=model, system=system, messages=[marked_turn]).input_tokens
    whole = claude.messages.create(**ask, messages=[marked_turn, *rest])
    total = _total(whole.usage)
    assert total > upto_mark + 64  # the unmarked rest is long enough to tell apart
    _flood(oai, model, "flood-m")
    again = claude.messages.create(**ask, messages=[marked_turn, *rest])
    read = again.usage.cache_read_input_tokens
    # the marked prefix (its full blocks; the chat template closes the turn, so the cut
    # renders a few tokens more than count_tokens' generation prompt differs by) and no more
    assert upto_mark - 32 <= read <= upto_mark + 16, (read, upto_mark, total)


def _total(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def test_a_low_priority_flood_leaves_a_normal_prompt_cached(server, oai):
    """vLLM's `priority` above 0 marks a request's own blocks to go first: a flood at priority 1
    leaves an earlier prompt cached; the same flood at priority 0 (the control) evicts it."""
    model = server.model_name()

    def cached(prompt: str) -> int:
        reply = oai.completions.create(model=model, max_tokens=1, temperature=0.0, prompt=prompt)
        return reply.usage.prompt_tokens_details.cached_tokens

    def flood(tag: str, priority: int) -> None:
        for i in range(8):
            oai.completions.create(model=model, max_tokens=1, temperature=0.0,
                                   prompt=f"{tag} {i}: " + _text(f"{tag}-{i}", 5),
                                   extra_body={"priority": priority})

    kept, lost = _text("kept-by-priority"), _text("lost-without-priority")
    assert cached(kept) == 0
    flood("batch-low", 1)
    assert cached(kept) >= 64
    assert cached(lost) < 16  # new (a partial block may match its first tokens)
    flood("batch-normal", 0)
    assert cached(lost) < 16
