"""`kvmemo`'s argument parser: one subcommand per job, each with its flag groups."""

from __future__ import annotations

import argparse

from kvmemo.cli.flags import add_engine_flags, add_http_flags, add_sampling_flags
from kvmemo.config import SERVING_MAX_NUM_BATCHED_TOKENS


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
    add_sampling_flags(gen)
    add_engine_flags(gen)
    chat = sub.add_parser(
        "chat",
        help="interactive multi-turn chat (the conversation's KV is reused every turn)",
    )
    chat.add_argument("--system", default=None, help="system prompt")
    add_sampling_flags(chat)
    add_engine_flags(chat)
    serve = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server (needs the `serve` extra)",
    )
    add_http_flags(serve)
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
    add_engine_flags(serve, SERVING_MAX_NUM_BATCHED_TOKENS)
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
    add_http_flags(ray_serve)
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
    add_engine_flags(ray_serve, SERVING_MAX_NUM_BATCHED_TOKENS)
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

