"""The engine: its assembly (builder), scheduler, model runner, sampler, output processor, beam
search driver, the step loop and its async wrapper. The names below are its API: nothing else in
kvmemo imports its modules (tests/engine/test_engine_boundary.py checks it); tests and
benchmarks may reach inside.
"""

from __future__ import annotations

from kvmemo.engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from kvmemo.engine.beam_search import BeamSearchParams
from kvmemo.engine.engine import Engine
from kvmemo.engine.request_stream import RequestStream, StreamItem
from kvmemo.engine.stats import EngineStats, KVInfo, MemoryStats, StoreTierStats

__all__ = [
    "AsyncEngine",
    "BeamSearchParams",
    "Engine",
    "EngineDeadError",
    "EngineStats",
    "KVInfo",
    "MemoryStats",
    "QueueFullError",
    "RequestStream",
    "StoreTierStats",
    "StreamItem",
]
