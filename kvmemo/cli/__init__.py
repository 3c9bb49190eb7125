"""The `kvmemo` command: generate and chat on the bundled SmolLM2 model or any supported model,
serve it, route between servers, or say which instruction sets it computes with.

Invariant: bad input prints one clear `error: ...` line and exits with status 2, no traceback.
flags.py holds the flag groups, parser.py the subcommands, commands.py what each does.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading

from kvmemo.cli.commands import (
    cmd_chat,
    cmd_generate,
    cmd_isa,
    cmd_ray_serve,
    cmd_router,
    cmd_serve,
)
from kvmemo.cli.flags import engine_options
from kvmemo.cli.parser import build_parser

__all__ = ["build_parser", "engine_options", "main", "run"]


def run() -> None:
    """The `kvmemo` command's entry: main(), then the process's end without the interpreter's
    teardown of torch (0.3-0.4 s of every command here, after the answer is printed). What a
    normal exit would still do is done first: the exit handlers run (the KV store's save queue
    drains, logging flushes) and the streams flush. Where a non-daemon thread is still running,
    the interpreter ends as usual, joining it."""
    code = main()
    others = [t for t in threading.enumerate() if t is not threading.main_thread()]
    if any(t.is_alive() and not t.daemon for t in others):
        sys.exit(code)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "router":
            return cmd_router(args)
        if args.command == "ray-serve":
            return cmd_ray_serve(args)
        if args.command == "isa":
            return cmd_isa(args)
        return cmd_chat(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
