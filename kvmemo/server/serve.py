"""`kvmemo serve`: build the Engine, wrap it in an AsyncEngine and run the app under uvicorn.

Invariant: the engine is built (model loaded, KV pool allocated) before the port opens, so a
200 from /health means requests will be served.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvmemo.server.kv_events import EventPublisher

logger = logging.getLogger(__name__)


def default_model_name(model: str | None) -> str:
    """The served model name: the model file's stem or the directory's name."""
    if model is None:
        from kvmemo.model.loading.loader import bundled_model_path

        model = bundled_model_path()
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name


def serve(
    model: str | None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_waiting: int = 256,
    served_model_name: str | None = None,
    engine_options: dict[str, Any] | None = None,
    kv_events_endpoint: str | None = None,
    kv_events_format: str = "kvmemo",
    kv_events_replay_endpoint: str | None = None,
) -> None:
    import uvicorn

    from kvmemo.config import EngineConfig
    from kvmemo.engine import AsyncEngine, Engine
    from kvmemo.server.app import create_app

    options = dict(engine_options or {})
    if kv_events_endpoint is not None:
        options["enable_kv_events"] = True
    config = EngineConfig.from_kwargs(model=model, **options)
    inner = Engine(config)
    publisher: EventPublisher | None = None
    if kv_events_endpoint is not None:
        from kvmemo.server.kv_events import KVEventPublisher  # needs pyzmq and msgpack

        if kv_events_format == "vllm":  # routers written for vLLM consume it unchanged
            from kvmemo.server.vllm_kv_events import VllmKVEventPublisher

            medium = "GPU" if inner.device.type == "cuda" else "CPU"
            publisher = VllmKVEventPublisher(
                kv_events_endpoint, replay_endpoint=kv_events_replay_endpoint, medium=medium
            )
        elif kv_events_replay_endpoint is not None:
            raise ValueError("--kv-events-replay-endpoint needs --kv-events-format vllm")
        else:
            publisher = KVEventPublisher(kv_events_endpoint)
        # Subscribed before the engine thread starts: publish() runs on that thread only.
        inner.subscribe_kv_events(publisher.publish)
        logger.info("KV events on %s", kv_events_endpoint)
    # The engine steps on this (the main) thread and the HTTP server runs beside it: model steps
    # ran 10-20% slower on a second thread on the machine measured (docs/benchmarks.md).
    engine = AsyncEngine(inner, max_waiting=max_waiting, start_thread=False)
    name = served_model_name or default_model_name(model)
    app = create_app(engine, model_name=name, api_key=api_key, kv_events=publisher)
    server = uvicorn.Server(
        uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False)
    )
    http = threading.Thread(target=_run_http, args=(server, engine), name="kvmemo-http",
                            daemon=True)
    # uvicorn handles signals only on the main thread: here SIGTERM stops like Ctrl-C.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    http.start()
    logger.info("serving %s on http://%s:%d/v1", name, host, port)
    try:
        engine.run()  # until the app's shutdown stops the engine, or a signal
    except KeyboardInterrupt:
        pass
    finally:
        server.should_exit = True
        engine.shutdown()
        http.join(_HTTP_STOP_S)
        signal.signal(signal.SIGTERM, previous)
        if publisher is not None:
            publisher.close()


_HTTP_STOP_S = 15.0  # for open connections to finish once the server is asked to stop


def _run_http(server: Any, engine: Any) -> None:
    """uvicorn's loop on this thread; when it ends (it failed to bind, or was stopped), the
    engine stops too, so the main thread's run() returns."""
    try:
        server.run()
    finally:
        engine.shutdown()
