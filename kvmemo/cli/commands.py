"""What each `kvmemo` subcommand does, given its parsed arguments; each returns the exit status."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from kvmemo.cli.flags import engine_options, sampling_params


def cmd_generate(args: argparse.Namespace) -> int:
    from kvmemo.llm import LLM

    params = sampling_params(args)
    if args.beam_width is not None:
        if args.image:
            raise ValueError("--image is not supported with --beam-width yet; drop one of them")
        return cmd_beam_search(args, params)
    llm = LLM(args.model, **engine_options(args))
    images = args.image or []
    if args.chat:
        content: Any = args.prompt
        if images:  # the images first, then the question (LLaVA's training layout)
            content = [
                *({"type": "image", "image": path} for path in images),
                {"type": "text", "text": args.prompt},
            ]
        out = llm.chat([{"role": "user", "content": content}], params, use_tqdm=False)[0]
    elif images:  # the intake places images before a prompt without markers
        out = llm.generate({"prompt": args.prompt, "images": images}, params,
                           use_tqdm=False)[0]
    else:
        out = llm.generate(args.prompt, params, use_tqdm=False)[0]
    completion = out.outputs[0]
    if args.json:
        print(json.dumps({
            "text": completion.text,
            "token_ids": completion.token_ids,
            "finish_reason": completion.finish_reason,
            "prompt_tokens": out.metrics.num_prompt_tokens,
            "cached_prompt_tokens": out.metrics.num_cached_tokens,
            "uncached_prompt_tokens_by_cause": out.metrics.uncached_tokens_by_cause,
            "ttft_s": out.metrics.ttft_s,
            "latency_s": out.metrics.latency_s,
            "draft_tokens": out.metrics.num_draft_tokens,
            "accepted_tokens": out.metrics.num_accepted_tokens,
        }))
    else:
        print(completion.text)
    if args.verbose:
        metrics, causes = out.metrics, out.metrics.uncached_tokens_by_cause or {}
        print(f"prompt: {metrics.num_prompt_tokens} tokens, {metrics.num_cached_tokens} from the "
              "cache; computed: " + (", ".join(
                  f"{n} {c}" + (f" (by {llm.config.eviction_policy})" if c == "evicted" else "")
                  for c, n in causes.items()) or "none"),
              file=sys.stderr)
        if llm.config.speculative_config is not None:
            drafted, kept = out.metrics.num_draft_tokens, out.metrics.num_accepted_tokens
            print(
                f"speculative ({llm.config.speculative_config.method}): {kept} of {drafted} "
                f"drafted tokens accepted ({kept / max(drafted, 1):.0%}); "
                f"{len(completion.token_ids)} tokens in "
                f"{len(completion.token_ids) - kept} steps",
                file=sys.stderr,
            )
        mem = llm.memory_stats()
        print(
            f"memory: weights {mem.weights_bytes / 2**20:.0f} MiB, KV pool "
            f"{mem.kv_pool_bytes / 2**20:.0f} MiB (resident as it fills), peak RSS "
            f"{mem.peak_rss_bytes / 2**20:.0f} MiB",
            file=sys.stderr,
        )
    return 0


def cmd_beam_search(args: argparse.Namespace, params) -> int:
    from kvmemo.engine import BeamSearchParams
    from kvmemo.llm import LLM

    if (not params.is_greedy or params.top_p < 1.0 or params.top_k
            or params.seed is not None or params.stop):
        raise ValueError(
            "--beam-width is deterministic: drop --temperature, --top-p, --top-k, --seed and --stop"
        )
    BeamSearchParams(beam_width=args.beam_width, max_tokens=args.max_tokens)  # fail before loading
    llm = LLM(args.model, **engine_options(args))
    prompt = (
        llm.processor.process_chat([{"role": "user", "content": args.prompt}])
        if args.chat
        else args.prompt
    )
    out = llm.beam_search(
        prompt, beam_width=args.beam_width, max_tokens=args.max_tokens, use_tqdm=False
    )[0]
    beams = [
        {"text": c.text, "token_ids": c.token_ids, "score": c.score,
         "cumulative_logprob": c.cumulative_logprob, "finish_reason": c.finish_reason}
        for c in out.outputs
    ]
    if args.json:
        print(json.dumps({"beams": beams, "prompt_tokens": out.metrics.num_prompt_tokens,
                          "cached_prompt_tokens": out.metrics.num_cached_tokens,
                          "latency_s": out.metrics.latency_s}))
    else:
        for i, beam in enumerate(beams):
            print(f"[beam {i}, score {beam['score']:.4f}] {beam['text']}")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from kvmemo.llm import LLM

    params = sampling_params(args)
    llm = LLM(args.model, **engine_options(args))
    conversation: list[dict[str, str]] = []
    if args.system:
        conversation.append({"role": "system", "content": args.system})
    print(
        "kvmemo chat: type a message, /reset to start over, /exit or Ctrl-D to quit.",
        file=sys.stderr,
    )
    while True:
        try:
            line = input("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not line:
            continue
        if line == "/exit":
            return 0
        if line == "/reset":
            conversation = conversation[:1] if args.system else []
            continue
        conversation.append({"role": "user", "content": line})
        out = llm.chat(conversation, params, use_tqdm=False)[0]
        reply = out.outputs[0].text
        conversation.append({"role": "assistant", "content": reply})
        print(f"assistant> {reply}")
        m = out.metrics
        ttft = "" if m.ttft_s is None else f", ttft {m.ttft_s * 1000:.0f} ms"
        print(
            f"[{m.num_prompt_tokens} prompt tokens, {m.num_cached_tokens} cached{ttft}]",
            file=sys.stderr,
        )


def cmd_serve(args: argparse.Namespace) -> int:
    from kvmemo.server.serve import serve

    if args.max_waiting < 0:
        raise ValueError(f"--max-waiting must be >= 0, got {args.max_waiting}")
    # Request and stats lines are the server's log, not debug detail: show them by default.
    for name in ("kvmemo.server", "kvmemo.engine.async_engine"):
        logging.getLogger(name).setLevel(logging.INFO)
    serve(
        args.model,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        max_waiting=args.max_waiting,
        served_model_name=args.served_model_name,
        engine_options=engine_options(args),
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_format=args.kv_events_format,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint,
    )
    return 0


def cmd_ray_serve(args: argparse.Namespace) -> int:
    try:
        import ray  # noqa: F401

        from kvmemo.integrations.ray_serve import Autoscaling, build_app, run
    except ImportError as exc:
        raise ValueError(f"kvmemo ray-serve needs Ray Serve: pip install 'kvmemo[ray]' ({exc})")
    autoscaling = None
    if args.min_replicas is not None or args.max_replicas is not None:
        if args.min_replicas is None or args.max_replicas is None:
            raise ValueError("autoscaling needs both --min-replicas and --max-replicas")
        autoscaling = Autoscaling(args.min_replicas, args.max_replicas,
                                  args.target_ongoing_requests)
    app = build_app(
        args.model,
        engine_options=engine_options(args),
        num_replicas=args.num_replicas,
        autoscaling=autoscaling,
        replica_cpus=args.replica_cpus,
        replica_gpus=args.replica_gpus,
        max_ongoing_requests=args.max_ongoing_requests,
        router=args.router,
        served_model_name=args.served_model_name,
        api_key=args.api_key,
    )
    print(f"kvmemo on Ray Serve: http://{args.host}:{args.port}/v1 (Ctrl-C stops)", file=sys.stderr)
    run(app, address=args.address, host=args.host, port=args.port)
    return 0


def cmd_router(args: argparse.Namespace) -> int:
    from kvmemo.routing.router import run_router

    logging.getLogger("kvmemo.server").setLevel(logging.INFO)
    run_router(
        args.replica,
        model=args.model,
        host=args.host,
        port=args.port,
        policy=args.policy,
        balance_threshold=args.balance_threshold,
        health_interval_s=args.health_interval,
    )
    return 0


def cmd_isa(args: argparse.Namespace) -> int:
    from kvmemo import isa

    print("\n".join(isa.levels_below_native()) if args.below else isa.describe())
    return 0

