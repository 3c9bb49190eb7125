"""Which kvmemo files one chat request crosses, from its route to its first sampled token.

A runtime trace, not a reading of the imports: the OpenAI server is built in-process around the
bundled model, a streamed chat request is sent once to warm up and once traced (both the server's
and the engine's thread), from the route's entry until the sampler returns the request's first
token. A file is *crossed* when one of its functions calls into another kvmemo file on that way;
files only entered (dataclasses, hashing, the free queue) are listed apart as *touched*.

    python -m benchmarks.micro.request_walk [--model PATH] [--json]

Issue 39's goal is at most 12 crossed files.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from types import FrameType
from typing import Any

import kvmemo

PACKAGE = os.path.dirname(kvmemo.__file__)
TOKEN_FUNCTIONS = {("engine/sampler.py", "sample"), ("engine/model_runner.py", "_greedy_tokens")}


class Walk:
    """The profile hook: records kvmemo calls between start() and the first sampled token."""

    def __init__(self) -> None:
        self.on = False
        self.touched: dict[str, int] = {}  # file -> calls, in first-call order
        self.crossed: dict[str, set[str]] = {}  # file -> the files it called into
        self.first_call: dict[tuple[str, str], str] = {}  # (file, file) -> "caller -> callee"

    def start(self) -> None:
        self.touched.clear()
        self.crossed.clear()
        self.first_call.clear()
        self.on = True

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.on or event not in ("call", "return"):
            return
        here = _package_file(frame)
        if here is None:
            return
        if event == "return":
            if (here, frame.f_code.co_name) in TOKEN_FUNCTIONS:
                self.on = False  # the first token is sampled: the walk ends here
            return
        self.touched[here] = self.touched.get(here, 0) + 1
        caller = frame.f_back
        while caller is not None and _package_file(caller) is None:
            caller = caller.f_back
        if caller is not None and (there := _package_file(caller)) != here:
            assert there is not None
            self.crossed.setdefault(there, set()).add(here)
            self.first_call.setdefault(
                (there, here), f"{caller.f_code.co_name} -> {frame.f_code.co_name}")


def _package_file(frame: FrameType) -> str | None:
    path = frame.f_code.co_filename
    return os.path.relpath(path, PACKAGE) if path.startswith(PACKAGE + os.sep) else None


def trace_one_request(model: str) -> Walk:
    from fastapi.testclient import TestClient

    from kvmemo.config import EngineConfig
    from kvmemo.engine.async_engine import AsyncEngine
    from kvmemo.engine.engine import Engine
    from kvmemo.server.app import create_app

    walk = Walk()
    # Installed before the engine thread starts, so that thread carries the hook too.
    threading.setprofile(walk)
    sys.setprofile(walk)
    try:
        engine = AsyncEngine(Engine(EngineConfig(model=model)))
        body = {
            "model": "m", "max_tokens": 4, "stream": True,
            "messages": [{"role": "system", "content": "You are brief."},
                         {"role": "user", "content": "Name a colour."}],
        }
        with TestClient(create_app(engine, model_name="m")) as client:
            client.post("/v1/chat/completions", json=body)  # warm: kernels built, caches filled
            body["messages"][1]["content"] = "Name a fruit."  # a prefix hit, a new suffix
            walk.start()
            client.post("/v1/chat/completions", json=body)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return walk


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="GGUF path (default: the bundled SmolLM2)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--why", action="store_true",
                        help="name the first call behind each crossing (caller -> callee)")
    args = parser.parse_args(argv)
    from kvmemo.model.loading.loader import bundled_model_path

    walk = trace_one_request(args.model or str(bundled_model_path()))
    crossed = list(walk.crossed)
    touched_only = [f for f in walk.touched if f not in walk.crossed]
    if args.json:
        print(json.dumps({"crossed": crossed, "touched_only": touched_only}, indent=1))
        return
    print(f"{len(crossed)} files crossed from the route to the first sampled token:")
    for name in crossed:
        print(f"  {name:34s} -> {', '.join(sorted(walk.crossed[name]))}")
        if args.why:
            for there in sorted(walk.crossed[name]):
                print(f"      {there}: {walk.first_call[(name, there)]}")
    print(f"{len(touched_only)} more files only entered: {', '.join(touched_only)}")


if __name__ == "__main__":
    main()
