"""AsyncEngine: an Engine driven by its own thread, streaming RequestOutputs to asyncio callers.

Invariant: only the engine thread touches the Engine (tokenizer included); callers talk to it
through a command list guarded by a condition, and outputs come back on one asyncio queue per
request via loop.call_soon_threadsafe. Every added sequence ends with exactly one finished
output, an abort, or an error on its queue. Callers see only the methods below: the engine's
limits, stats and KV info, never its parts.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, cast

from kvmemo.connector.line_log import disk_store_dir
from kvmemo.engine.engine import Engine
from kvmemo.engine.request_stream import RequestStream, StreamItem
from kvmemo.engine.stats import EngineStats, KVInfo
from kvmemo.intake.prompt_input import PromptInput
from kvmemo.kv.hashing import BlockHash
from kvmemo.kv.retention import Retention
from kvmemo.outputs import RequestOutput, RequestOutputKind
from kvmemo.sampling import SamplingParams

logger = logging.getLogger(__name__)

_STATS_INTERVAL_S = 10.0
_IDLE_WAKE_S = 0.25  # an idle engine loop looks for signals this often (see _loop)


class QueueFullError(Exception):
    """The bounded waiting queue is full; the caller should retry later (HTTP 503)."""


class EngineDeadError(Exception):
    """The engine thread stopped or a step failed; the request cannot complete."""


@dataclass
class _Add:
    request_id: str
    inputs: PromptInput
    params: SamplingParams
    cache_salt: str | None
    retention: tuple[Retention, ...]
    priority: int
    fill_context: bool  # max_tokens = whatever context the prompt leaves
    echo: bool  # the stream needs the prompt as text
    stream: RequestStream
    done: asyncio.Future
    # The text prompt's token ids, when it was tokenized with the other adds of its batch
    token_ids: list[int] | None = None


@dataclass
class _Abort:
    sequence_ids: list[str]


@dataclass
class _Call:
    fn: Any
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future


@dataclass
class _Sequence:
    stream: RequestStream
    index: int
    wants_logprobs: bool
    delta: bool = False  # its outputs are deltas (RequestOutputKind.DELTA)
    num_logprob_entries: int = 0
    prompt_texts_sent: bool = False  # the prompt logprobs' token texts went out


class AsyncEngine:
    """Owns an Engine and the thread that steps it.

    Args:
        engine: a built Engine; nothing else may use it afterwards.
        max_waiting: at most this many sequences may wait for admission; a request that would
            exceed it is refused with QueueFullError.
    """

    def __init__(self, engine: Engine, max_waiting: int = 256, *, start_thread: bool = True):
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.engine = engine
        self.max_waiting = max_waiting
        self._cond = threading.Condition()
        self._commands: list[_Add | _Call | _Abort] = []
        self._stopped = False
        self._sequences: dict[str, _Sequence] = {}
        self._ids = itertools.count()
        self.stats: EngineStats = engine.stats()  # the engine thread's latest snapshot
        self.max_model_len: int = engine.max_model_len
        self.chat_template: str | None = engine.processor.chat_template  # read-only here
        # Thread-safe: the server reads the ids replies were generated as and seeds them back
        # after a restart (server/response_store.py).
        self.reply_tokens = engine.processor.reply_tokens
        self.disk_store_dir = disk_store_dir(engine.kv_connector)  # None without a disk store
        self._kv_info = engine.kv_info()  # fixed when the engine is built
        self.num_generated_tokens = 0
        self._thread = threading.Thread(target=self._loop, name="kvmemo-engine", daemon=True)
        self._owns_thread = start_thread
        if start_thread:
            self._thread.start()

    def run(self) -> None:
        """Step the engine on the calling thread until shutdown() (for an AsyncEngine built
        with start_thread=False). `kvmemo serve` runs it on the main thread and the HTTP server
        beside it: steps ran 10-20% slower on a second thread on the machine measured (AMD
        EPYC Zen 5; docs/benchmarks.md, "Served")."""
        if self._owns_thread:
            raise RuntimeError("this AsyncEngine steps on its own thread already")
        self._thread = threading.current_thread()
        self._loop()

    # ---- caller side (any thread with a running asyncio loop) -----------------------------

    async def add_request(
        self,
        params: SamplingParams,
        inputs: PromptInput,
        *,
        cache_salt: str | None = None,
        retention: tuple[Retention, ...] = (),
        priority: int = 0,
        request_id: str | None = None,
        echo: bool = False,
        fill_context: bool = False,
    ) -> RequestStream:
        """Queue one request of params.n sequences; returns once the engine accepted it.

        inputs: the prompt, chat or segments and the options that shape its tokens (the
        engine thread hands it to InputProcessor.process). Raises ValueError (bad prompt, too
        long, bad cache_salt, retention past its quota), QueueFullError or EngineDeadError.
        retention: prompt prefixes kept cached after it ends (kv/retention.py). priority: vLLM's;
        above 0, its own blocks are evicted first when it ends. echo: the stream's
        prompt_text holds the prompt as text (decoded, for a token-id prompt). fill_context:
        max_tokens is whatever context the prompt leaves.
        """
        if not isinstance(inputs, PromptInput):
            raise TypeError(f"inputs must be a PromptInput, got {type(inputs).__name__}")
        loop = asyncio.get_running_loop()
        request_id = request_id or f"req-{next(self._ids)}"
        stream = RequestStream(self._abort, request_id, params.n, loop)
        done = loop.create_future()
        self._submit(
            _Add(request_id, inputs, params, cache_salt, tuple(retention), priority, fill_context,
                 echo, stream, done)
        )
        try:
            await done
        except asyncio.CancelledError:
            stream.abort()  # the add may still land; aborting unknown ids is harmless
            raise
        return stream

    async def call(self, fn) -> Any:
        """Run fn(engine) on the engine thread between steps and return its result."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._submit(_Call(fn, loop, done))
        return await done

    async def reset_prefix_cache(self) -> tuple[bool, str]:
        return await self.call(lambda engine: engine.reset_prefix_cache())

    def kv_info(self) -> KVInfo:
        """How the engine names its blocks (fixed for its life)."""
        return self._kv_info

    async def cached_block_hashes(self) -> list[BlockHash]:
        """The hashes of every block a prompt could hit now, read between steps."""
        return await self.call(lambda engine: engine.cached_block_hashes())

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop stepping; fail the open requests. Waits for the engine's own thread (a run()
        on a caller's thread returns by itself)."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._owns_thread:
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return (self._thread.is_alive() or not self._owns_thread) and not self._stopped

    def _abort(self, sequence_ids: list[str]) -> None:
        with self._cond:
            self._commands.append(_Abort(list(sequence_ids)))
            self._cond.notify()

    def _submit(self, command: _Add | _Call) -> None:
        with self._cond:
            if not self.is_alive:
                raise EngineDeadError("the engine is not running")
            self._commands.append(command)
            self._cond.notify()

    # ---- engine thread --------------------------------------------------------------------

    def _loop(self) -> None:
        last_stats = time.monotonic()
        tokens_at_last_stats = 0
        while True:
            with self._cond:
                while (
                    not self._commands
                    and not self._stopped
                    and not self.engine.has_unfinished_requests()
                ):
                    # A timed wait: on the main thread (`kvmemo serve`) a SIGTERM or Ctrl-C
                    # that the kernel hands to another thread (HTTP, AnyIO workers, OpenMP)
                    # wakes nobody, and its handler runs only when this thread runs Python
                    # again: an untimed wait left the server deaf to it until a request came.
                    self._cond.wait(_IDLE_WAKE_S)
                if self._stopped:
                    break
                commands, self._commands = self._commands, []
            self._tokenize_texts(commands)
            for command in commands:
                self._apply(command)
            if self.engine.has_unfinished_requests():
                try:
                    outputs = self.engine.step()
                except Exception as e:  # a failed step poisons every request in the batch
                    logger.exception("engine step failed; failing all requests")
                    self._fail_all(EngineDeadError(f"engine step failed: {e}"))
                    outputs = []
                self.num_generated_tokens += len(outputs)
                for out in outputs:
                    self._deliver(out)
            self.stats = self.engine.stats()
            now = time.monotonic()
            if now - last_stats >= _STATS_INTERVAL_S:
                if (
                    self.num_generated_tokens > tokens_at_last_stats
                    or self.engine.has_unfinished_requests()
                ):
                    self._log_stats(
                        now - last_stats, self.num_generated_tokens - tokens_at_last_stats
                    )
                last_stats, tokens_at_last_stats = now, self.num_generated_tokens
        self._fail_all(EngineDeadError("the engine was shut down"), pending=True)

    def _queue_full(self, num_waiting: int, n: int) -> bool:
        """Admitting n more sequences behind num_waiting would pass max_waiting."""
        return num_waiting + n > self.max_waiting

    def _tokenize_texts(self, commands: list[_Add | _Call | _Abort]) -> None:
        """The text prompts of a burst of adds in one tokenizer call (it encodes a batch on
        every core, at about half the time of one call per prompt: 63 random-token prompts of
        1,056 tokens took ~90 ms against ~190, Zen 4), so the burst's first step starts
        sooner. A prompt the batch cannot encode is left to its own add, which reports it."""
        if not commands:  # the engine loop's usual pass: nothing arrived since the last step
            return
        processor = self.engine.processor
        waiting = self.engine.num_waiting
        texts = []
        for c in commands:
            if not isinstance(c, _Add):
                continue
            if self._queue_full(waiting, c.params.n):
                continue  # _add turns it away (503) before any tokenizing: keep that cheap
            waiting += c.params.n
            prompt = c.inputs.prompt
            if (isinstance(prompt, str) and prompt and not c.inputs.images
                    and processor.blend_pieces(prompt) is None):
                texts.append(c)  # (segments are encoded piece by piece)
        for special in (True, False):
            batch = [c for c in texts if c.inputs.add_special_tokens is special]
            if len(batch) < 2:
                continue
            try:
                encoded = processor.encode_texts(
                    [cast(str, c.inputs.prompt) for c in batch], add_special_tokens=special
                )
            except Exception:  # noqa: BLE001 -- each add then encodes and reports its own
                continue
            for command, token_ids in zip(batch, encoded):
                command.token_ids = token_ids

    def _apply(self, command: _Add | _Call | _Abort) -> None:
        if isinstance(command, _Abort):
            for sequence_id in command.sequence_ids:
                if self._sequences.pop(sequence_id, None) is not None:
                    self.engine.abort_request(sequence_id)
            return
        if isinstance(command, _Call):
            try:
                result = command.fn(self.engine)
            except Exception as e:
                _resolve(command.loop, command.done, error=e)
            else:
                _resolve(command.loop, command.done, result=result)
            return
        loop = command.stream._loop
        try:
            self._add(command)
        except Exception as e:  # noqa: BLE001 -- ValueError or QueueFullError, for the caller
            _resolve(loop, command.done, error=e)
        else:
            _resolve(loop, command.done, result=None)

    def _add(self, command: _Add) -> None:
        params = command.params
        num_waiting = self.engine.num_waiting
        if self._queue_full(num_waiting, params.n):
            raise QueueFullError(
                f"the server is overloaded: {num_waiting} requests are waiting "
                f"(limit {self.max_waiting}); retry later"
            )
        prompt = self.engine.processor.process(command.inputs, command.cache_salt,
                                               token_ids=command.token_ids)
        if command.fill_context:
            room = self.max_model_len - len(prompt.token_ids)
            params = params.with_max_tokens(max(room, 1))
        command.stream.prompt_token_ids = prompt.token_ids
        if command.echo:
            command.stream.prompt_text = (
                prompt.text if prompt.text is not None
                else self.engine.tokenizer.decode(prompt.token_ids)
            )
        samples = list(zip(command.stream.sequence_ids, params.per_sample()))
        self.engine.add_requests(
            [(sequence_id, prompt, sample) for sequence_id, sample in samples],
            cache_salt=command.cache_salt,
            retention=command.retention,
            priority=command.priority,
        )
        for j, (sequence_id, _) in enumerate(samples):
            self._sequences[sequence_id] = _Sequence(
                command.stream, j, params.logprobs is not None,
                delta=params.output_kind == RequestOutputKind.DELTA)

    def _deliver(self, out: RequestOutput) -> None:
        sequence = self._sequences.get(out.request_id)
        if sequence is None:  # aborted by the caller while the step ran
            return
        logprobs = out.outputs[0].logprobs
        named: list[int] = []  # token ids whose texts the caller's logprobs need
        if (out.prompt_logprobs is not None and out.outputs[0].token_ids
                and not sequence.prompt_texts_sent):  # the whole prompt's are in
            named += [t for entry in out.prompt_logprobs
                      for t in entry or (out.prompt_token_ids[0],)]
            sequence.prompt_texts_sent = True
        if sequence.wants_logprobs and logprobs:
            # A delta output holds only new entries; a cumulative one all of them.
            new = logprobs if sequence.delta else logprobs[sequence.num_logprob_entries :]
            sequence.num_logprob_entries += len(new)
            named += [t for entry in new for t in entry]
        # Decoded here: the tokenizer is only safe to use from the engine thread.
        tokenizer = self.engine.tokenizer
        token_texts = {t: tokenizer.decode([t]) for t in dict.fromkeys(named)}
        sequence.stream._put(StreamItem(sequence.index, out, token_texts))
        if out.finished:
            del self._sequences[out.request_id]

    def _fail_all(self, error: Exception, *, pending: bool = False) -> None:
        """Fail every running sequence with `error`; with pending, also the commands not yet
        applied (at shutdown). A failed step leaves those alone: they arrived after the batch
        it poisoned, and the engine keeps serving (a client that saw the error and retried at
        once was failed too, while this thread was still here)."""
        for sequence_id, sequence in list(self._sequences.items()):
            try:
                self.engine.abort_request(sequence_id)
            except Exception:  # after a failed step the scheduler may be inconsistent; keep going
                logger.exception("abort of %s failed", sequence_id)
            sequence.stream._put(error)
        self._sequences.clear()
        if not pending:
            return
        with self._cond:
            commands, self._commands = self._commands, []
        for command in commands:
            if isinstance(command, _Add):
                _resolve(command.stream._loop, command.done, error=error)
            elif isinstance(command, _Call):
                _resolve(command.loop, command.done, error=error)

    def _log_stats(self, elapsed_s: float, num_tokens: int) -> None:
        s = self.stats
        logger.info(
            "stats: %.1f gen tok/s, running %d, waiting %d, KV usage %.1f%%, "
            "prefix hit rate %.1f%%",
            num_tokens / elapsed_s,
            s.num_running,
            s.num_waiting,
            100 * s.kv_usage,
            100 * s.prefix_cache_hit_rate,
        )


def _resolve(
    loop: asyncio.AbstractEventLoop,
    future: asyncio.Future,
    *,
    result: Any = None,
    error: BaseException | None = None,
) -> None:
    def settle() -> None:
        if future.done():  # the caller was cancelled
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the caller's loop is closed
        pass
