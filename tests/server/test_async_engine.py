"""AsyncEngine against a scripted fake Engine: streaming, n samples, aborts, a full queue, and a
failing step. No model, no HTTP: runs in a fraction of a second."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import pytest

from kvmemo.engine import AsyncEngine, EngineDeadError, QueueFullError
from kvmemo.engine.stats import EngineStats, KVInfo
from kvmemo.intake.processor import ProcessedPrompt
from kvmemo.intake.prompt_input import PromptInput
from kvmemo.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvmemo.sampling import SamplingParams


class _Processor:
    chat_template = None
    reply_tokens = None

    def __init__(self):
        self.batches: list[list[str]] = []  # encode_texts calls
        self.batch_error: Exception | None = None  # what encode_texts raises, if set

    # InputProcessor's front door; segments and documents (chunk KV reuse) are not exercised.
    def process(self, inputs, cache_salt=None, *, token_ids=None):
        if inputs.messages is not None:
            return self.process_chat(inputs.messages, inputs.chat_options, cache_salt=cache_salt)
        prompt = inputs.prompt
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must be a non-empty string")
            return ProcessedPrompt(token_ids or [ord(c) for c in prompt], prompt)
        return ProcessedPrompt(list(prompt))

    def blend_pieces(self, text):
        return None  # no blend separator

    def encode_texts(self, texts, add_special_tokens=True):
        self.batches.append(list(texts))
        if self.batch_error is not None:
            raise self.batch_error
        return [[ord(c) + 1000 for c in t] for t in texts]  # marked: from the batch call

    def process_chat(self, messages, options=None, cache_salt=None, documents=None,
                     kv_reuse=None, recompute_ratio=None):
        return self.process(PromptInput(prompt="".join(m["content"] for m in messages)))


@dataclass
class _Scheduler:
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)


class FakeEngine:
    """Each step gives every sequence one token 'x' (at most 2 sequences run at once)."""

    def __init__(self, fail_on_step: int | None = None):
        self.processor = _Processor()
        self.scheduler = _Scheduler()
        self.tokenizer = None
        self.kv_connector = None
        self.max_model_len = 64
        self.params: dict[str, SamplingParams] = {}
        self.added: dict[str, SamplingParams] = {}  # every request ever added
        self.tokens: dict[str, list[int]] = {}
        self.aborted: list[str] = []
        self.num_steps = 0
        self.fail_on_step = fail_on_step

    def add_requests(self, batch, *, cache_salt=None, retention=(), priority=0):
        for request_id, prompt, params in batch:
            if len(prompt.token_ids) > self.max_model_len:
                raise ValueError("prompt is too long")
        for request_id, prompt, params in batch:
            self.params[request_id] = self.added[request_id] = params
            self.tokens[request_id] = []
            self.scheduler.waiting.append(request_id)

    @property
    def num_waiting(self):
        return len(self.scheduler.waiting)

    def kv_info(self):
        return KVInfo("fake", b"root", 16, "sha256", 8, "float32")

    def abort_request(self, request_id):
        self.aborted.append(request_id)
        self._drop(request_id)

    def _drop(self, request_id):
        self.params.pop(request_id, None)
        if request_id in self.scheduler.waiting:
            self.scheduler.waiting.remove(request_id)
        if request_id in self.scheduler.running:
            self.scheduler.running.remove(request_id)

    def has_unfinished_requests(self):
        return bool(self.scheduler.waiting or self.scheduler.running)

    def step(self):
        self.num_steps += 1
        time.sleep(0.001)  # a step takes time, as a real one does
        if self.num_steps == self.fail_on_step:
            raise RuntimeError("boom")
        while self.scheduler.waiting and len(self.scheduler.running) < 2:
            self.scheduler.running.append(self.scheduler.waiting.popleft())
        outputs = []
        for rid in list(self.scheduler.running):
            self.tokens[rid].append(120)
            done = len(self.tokens[rid]) >= self.params[rid].max_tokens
            completion = CompletionOutput(
                0, "x" * len(self.tokens[rid]), list(self.tokens[rid]), "length" if done else None
            )
            metrics = RequestMetrics(0.0, 3, first_token_time=1.0)
            outputs.append(RequestOutput(rid, None, [1, 2, 3], [completion], done, metrics))
            if done:
                self._drop(rid)
        return outputs

    def stats(self):
        return EngineStats(
            *(0,) * 2, len(self.scheduler.running), len(self.scheduler.waiting), *(0,) * 9
        )


async def _collect(stream):
    texts: dict[int, str] = {}
    async for item in stream:
        texts[item.index] = item.output.outputs[0].text
    return texts


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=10))


def test_concurrent_requests_and_n_samples():
    engine = AsyncEngine(FakeEngine(), max_waiting=16)

    async def main():
        a = await engine.add_request(SamplingParams(max_tokens=3), PromptInput(prompt="abc"))
        b = await engine.add_request(
            SamplingParams(max_tokens=2, n=3),
            PromptInput(messages=[{"role": "user", "content": "hi"}]),
        )
        return await asyncio.gather(_collect(a), _collect(b))

    try:
        a, b = _run(main())
    finally:
        engine.shutdown()
    assert a == {0: "xxx"}
    assert b == {0: "xx", 1: "xx", 2: "xx"}


def test_a_burst_of_text_prompts_is_tokenized_in_one_call():
    """Adds that reach the engine thread together encode in one batch; a lone add and chat
    messages encode on their own."""
    fake = FakeEngine()
    engine = AsyncEngine(fake, start_thread=False)
    texts = ["ab", "cde", "f"]

    async def main():
        adds = [asyncio.create_task(engine.add_request(SamplingParams(max_tokens=1), PromptInput(prompt=t)))
                for t in texts]
        chat = asyncio.create_task(engine.add_request(
            SamplingParams(max_tokens=1), PromptInput(messages=[{"role": "user", "content": "hi"}])))
        await asyncio.sleep(0.05)  # every add is queued before the engine thread starts
        threading.Thread(target=engine.run, daemon=True).start()
        streams = await asyncio.gather(*adds, chat)
        await asyncio.gather(*(_collect(s) for s in streams))
        lone = await engine.add_request(SamplingParams(max_tokens=1), PromptInput(prompt="zz"))
        await _collect(lone)
        return streams, lone

    try:
        streams, lone = _run(main())
    finally:
        engine.shutdown()
    assert fake.processor.batches == [texts]
    assert [s.prompt_token_ids for s in streams[:3]] == [[ord(c) + 1000 for c in t] for t in texts]
    assert streams[3].prompt_token_ids == [ord("h"), ord("i")]
    assert lone.prompt_token_ids == [ord("z")] * 2


def _burst(engine: AsyncEngine, texts: list[str]) -> list:
    """Adds queued before the engine thread starts (one burst); each result or its error."""

    async def main():
        adds = [asyncio.create_task(engine.add_request(SamplingParams(max_tokens=1), PromptInput(prompt=t)))
                for t in texts]
        await asyncio.sleep(0.05)
        threading.Thread(target=engine.run, daemon=True).start()
        results = await asyncio.gather(*adds, return_exceptions=True)
        await asyncio.gather(*(_collect(r) for r in results if not isinstance(r, Exception)))
        return results

    try:
        return _run(main())
    finally:
        engine.shutdown()


def test_a_full_queue_turns_a_burst_away_before_tokenizing_it():
    fake = FakeEngine()
    results = _burst(AsyncEngine(fake, max_waiting=2, start_thread=False), ["a", "b", "c", "d"])
    assert fake.processor.batches == [["a", "b"]]  # only the adds that are admitted
    assert [isinstance(r, QueueFullError) for r in results] == [False, False, True, True]


def test_a_failed_batch_leaves_each_prompt_to_its_own_add():
    fake = FakeEngine()
    fake.processor.batch_error = ValueError("the tokenizer refused the batch")
    results = _burst(AsyncEngine(fake, start_thread=False), ["ab", "c"])
    assert [r.prompt_token_ids for r in results] == [[ord("a"), ord("b")], [ord("c")]]


def test_chat_without_max_tokens_fills_the_context():
    fake = FakeEngine()
    engine = AsyncEngine(fake)

    async def main():
        stream = await engine.add_request(
            SamplingParams(max_tokens=1), PromptInput(prompt="abcd"), fill_context=True
        )
        seen = fake.added[stream.sequence_ids[0]].max_tokens
        stream.abort()
        return seen

    try:
        assert _run(main()) == 64 - 4
    finally:
        engine.shutdown()


def test_bad_input_raises_value_error_and_queue_full_raises():
    fake = FakeEngine()
    engine = AsyncEngine(fake, max_waiting=2)

    async def main():
        with pytest.raises(ValueError, match="too long"):
            await engine.add_request(SamplingParams(), PromptInput(prompt=[1] * 100))
        with pytest.raises(ValueError, match="non-empty"):
            await engine.add_request(SamplingParams(), PromptInput(prompt=""))
        with pytest.raises(QueueFullError):
            await engine.add_request(SamplingParams(n=3), PromptInput(prompt="abc"))

    try:
        _run(main())
    finally:
        engine.shutdown()
    assert fake.params == {}  # nothing half-added


def test_abort_removes_every_sequence():
    fake = FakeEngine()
    engine = AsyncEngine(fake)

    async def main():
        stream = await engine.add_request(SamplingParams(max_tokens=10_000, n=2), PromptInput(prompt="abc"))
        async for _ in stream:
            break  # one token, then the client leaves
        stream.abort()
        while fake.has_unfinished_requests():
            await asyncio.sleep(0.01)
        return stream.sequence_ids

    try:
        ids = _run(main())
    finally:
        engine.shutdown()
    assert sorted(fake.aborted) == sorted(ids)


def test_failing_step_fails_requests_and_the_engine_keeps_serving():
    engine = AsyncEngine(FakeEngine(fail_on_step=1))

    async def main():
        stream = await engine.add_request(SamplingParams(max_tokens=3), PromptInput(prompt="abc"))
        with pytest.raises(EngineDeadError, match="boom"):
            await _collect(stream)
        again = await engine.add_request(SamplingParams(max_tokens=2), PromptInput(prompt="abc"))
        return await _collect(again)

    try:
        assert _run(main()) == {0: "xx"}
    finally:
        engine.shutdown()


def test_a_request_added_while_a_failed_step_is_cleaned_up_is_served():
    """The race behind a flaky run of the test above: a client that saw the failure and added
    again at once, while the engine thread was still failing the old batch, got the old
    batch's error. Here the add lands deterministically inside that window."""
    fake = FakeEngine(fail_on_step=1)
    engine = AsyncEngine(fake)
    added: list[asyncio.Future] = []

    async def main():
        loop = asyncio.get_running_loop()
        real_abort = fake.abort_request

        def abort_and_add_meanwhile(request_id):  # runs on the engine thread, in _fail_all
            added.append(asyncio.run_coroutine_threadsafe(engine.add_request(
                SamplingParams(max_tokens=2), PromptInput(prompt="abc")), loop))
            deadline = time.monotonic() + 5
            while not engine._commands and time.monotonic() < deadline:
                time.sleep(0.001)  # until the add is queued
            real_abort(request_id)

        fake.abort_request = abort_and_add_meanwhile
        stream = await engine.add_request(SamplingParams(max_tokens=3), PromptInput(prompt="abc"))
        with pytest.raises(EngineDeadError, match="boom"):
            await _collect(stream)
        fake.abort_request = real_abort
        again = await asyncio.wrap_future(added[0])
        return await _collect(again)

    try:
        assert _run(main()) == {0: "xx"}
    finally:
        engine.shutdown()


def test_shutdown_refuses_new_requests():
    engine = AsyncEngine(FakeEngine())
    engine.shutdown()

    async def main():
        with pytest.raises(EngineDeadError):
            await engine.add_request(SamplingParams(), PromptInput(prompt="abc"))

    _run(main())
