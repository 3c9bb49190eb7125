"""`kvmemo serve --speculative-config`: the OpenAI SDK sees the drafts in usage
(completion_tokens_details, OpenAI's predicted-output names) and /metrics counts them under
vLLM's spec-decode counter names; streamed and whole replies agree."""

from __future__ import annotations

import json

import pytest

from tests.server.conftest import launch_server

pytestmark = pytest.mark.model

MESSAGES = [{"role": "user", "content": "List the days of the week, one per line."}]


def test_drafts_show_in_usage_and_metrics():
    spec = json.dumps({"method": "suffix", "num_speculative_tokens": 12})
    with launch_server("--num-blocks", "256", "--speculative-config", spec) as server:
        client = server.openai()
        model = server.model_name()
        first = client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=40, temperature=0
        )
        second = client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=40, temperature=0
        )
        assert second.choices[0].message.content == first.choices[0].message.content
        details = second.usage.completion_tokens_details
        # The first reply is a stored greedy run now: the second replays it whole, as one
        # draft of 38 (the first token comes from the prompt's step, the last one after it).
        assert details.accepted_prediction_tokens == 38 and second.usage.completion_tokens == 40
        assert details.rejected_prediction_tokens == 0
        stream = client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=40, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == first.choices[0].message.content
        usages = [c.usage for c in chunks if c.usage is not None]
        kept = [second.usage, usages[-1]]
        if first.usage.completion_tokens_details is not None:
            kept.append(first.usage)
        metrics = server.metrics()
        accepted = sum(u.completion_tokens_details.accepted_prediction_tokens for u in kept)
        rejected = sum(u.completion_tokens_details.rejected_prediction_tokens for u in kept)
        assert metrics["kvmemo_spec_decode_num_accepted_tokens_total"] == accepted
        assert metrics["kvmemo_spec_decode_num_draft_tokens_total"] == accepted + rejected
        assert metrics["kvmemo_spec_decode_num_drafts_total"] > 0
