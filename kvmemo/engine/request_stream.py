"""RequestStream: the caller's end of one request on an AsyncEngine, an async iterator of
StreamItems (one per sequence update) that ends when every sequence has finished; the engine
thread puts items in, thread-safely, and an abort goes back to it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from kvmemo.outputs import RequestOutput


@dataclass(frozen=True)
class StreamItem:
    """One update of one sequence: its output (cumulative or a delta, as its SamplingParams'
    output_kind asks), and text for new logprob token ids."""

    index: int  # which of the request's n samples
    output: RequestOutput
    token_texts: dict[int, str] = field(default_factory=dict)


class RequestStream:
    """The caller's end of one request (n sequences): iterate it for StreamItems."""

    def __init__(
        self, abort: Callable[[list[str]], None], request_id: str, n: int,
        loop: asyncio.AbstractEventLoop,
    ):
        self._abort = abort  # the engine's: aborts sequences on the engine thread
        self.request_id = request_id
        self.sequence_ids = [f"{request_id}-{j}" for j in range(n)]
        self._loop = loop
        self._queue: asyncio.Queue[StreamItem | BaseException] = asyncio.Queue()
        self._num_open = n
        self.prompt_token_ids: list[int] = []
        self.prompt_text = ""  # set for a request added with echo=True

    def _put(self, item: StreamItem | BaseException) -> None:  # engine thread
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed; nobody is listening
            pass

    @property
    def finished(self) -> bool:
        return self._num_open == 0

    async def __aiter__(self) -> AsyncIterator[StreamItem]:
        while self._num_open > 0:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self._num_open = 0
                raise item
            if item.output.finished:
                self._num_open -= 1
            yield item

    def abort(self) -> None:
        """Abort every unfinished sequence and free its blocks (idempotent, never blocks long)."""
        if self._num_open > 0:
            self._num_open = 0
            self._abort(self.sequence_ids)
