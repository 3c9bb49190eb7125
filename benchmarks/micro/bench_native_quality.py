"""weights="native" against the exact fp32 mode (weights="dense", dtype float32) of the same GGUF:
teacher-forced agreement and perplexity, one row per weight format.

    python -m benchmarks.micro.bench_native_quality [--formats Q4_1,Q8_0,...] [--gemma]

Rows: the bundled SmolLM2 as shipped (Q4_1 layers, Q8_0 embedding/head), the same model with its
layer weights requantized by gguf-py to each 32-value format (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: both
modes read the same requantized file, so a row isolates the native kernels' error), and, with
--gemma, the packaged Gemma 3 270M Q4_K_M (Q4_K, Q6_K, Q5_0, Q8_0 tensors; gguf-py cannot write
K-quants). Agreement: the fp8 benchmark's 16 prompts, 64 greedy tokens of the fp32 mode as
reference; native predicts each next token with the reference as context, fed one token per step
through the paged cache (the decode path, where the int8 kernels run). Perplexity:
benchmarks/data/perplexity_text.txt in chunks of 16 tokens (the fp32 mode reads it in the same
chunks). Writes benchmarks/results/native_quality.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.machine_info import cpu_label
from benchmarks.micro.bench_fp8 import TEXT, paged_logits, prompts
from benchmarks.paths import RESULTS as RESULTS_DIR
from kvmemo import LLM, SamplingParams
from kvmemo.model.loading.loader import bundled_model_path, packaged_gemma3_path

RESULTS = RESULTS_DIR / "native_quality.json"
FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
CHUNK = 16
MAX_TOKENS = 64


def requantize(source: Path, target: Path, qtype_name: str) -> None:
    """source's GGUF with every quantized layer weight (blk.*) dequantized and quantized again
    to `qtype_name` by gguf-py; metadata, embedding and norms copied as they are."""
    import gguf
    from gguf.quants import dequantize, quantize

    qtype = gguf.GGMLQuantizationType[qtype_name]
    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(target), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for tensor in reader.tensors:
        data, raw = np.array(tensor.data), tensor.tensor_type
        shape = [int(d) for d in reversed(tensor.shape)]  # numpy order: [rows, cols]
        if tensor.name.startswith("blk.") and raw not in (gguf.GGMLQuantizationType.F32,):
            dense = dequantize(data, raw).reshape(shape).astype(np.float32)
            writer.add_tensor(tensor.name, quantize(dense, qtype), raw_dtype=qtype)
        elif raw == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(tensor.name, data.reshape(shape))
        else:
            writer.add_tensor(tensor.name, data, raw_dtype=raw)  # [rows, row bytes] as stored
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@torch.inference_mode()
def stepwise_argmax(llm: LLM, prompt: list[int], continuation: list[int]) -> list[int]:
    """The argmax after each position from the prompt's last token on, one token per step."""
    if llm.engine.layout.is_hybrid:  # per-group block tables: through the engine instead
        return _engine_stepwise_argmax(llm, prompt, continuation)
    logits = paged_logits(llm, prompt + continuation[:-1], chunk=1)
    return logits[len(prompt) - 1 :].argmax(dim=-1).tolist()


def _engine_stepwise_argmax(llm: LLM, prompt: list[int], continuation: list[int]) -> list[int]:
    """The same through LLM.generate: one greedy token after prompt + continuation[:i], the
    prefix cache computing just the new token each time (a one-row step, as in decode)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    return [llm.generate([prompt + continuation[:i]], greedy, use_tqdm=False)[0]
            .outputs[0].token_ids[0] for i in range(len(continuation))]


def perplexity(llm: LLM, token_ids: list[int]) -> float:
    if llm.engine.layout.is_hybrid:
        return _engine_perplexity(llm, token_ids)
    logits = paged_logits(llm, token_ids, CHUNK)
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(token_ids[1:]))
    return math.exp(float(nll))


def _engine_perplexity(llm: LLM, token_ids: list[int]) -> float:
    """From the engine's prompt log-probabilities, the prompt prefilled CHUNK tokens a step."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    (out,) = llm.generate([token_ids], params, use_tqdm=False)
    logprobs = [entry[token] for entry, token in zip(out.prompt_logprobs[1:], token_ids[1:])]
    return math.exp(-sum(logprobs) / len(logprobs))


def measure(path: Path, label: str, formats: str) -> dict:
    start = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    rows = {}
    reference: list[list[int]] = []
    for weights in ("dense", "native"):
        hybrid = "gemma" in label.lower()  # sliding-window layers: measured through the engine
        llm = LLM(str(path), weights=weights, dtype="float32", num_blocks=1024 if hybrid else 256,
                  enable_prefix_caching=hybrid,
                  max_num_batched_tokens=CHUNK if hybrid else 2048)
        prompt_ids = prompts(llm)
        text_ids = llm.engine.processor.encode_prompt(TEXT.read_text())
        if weights == "dense":
            outs = llm.generate(prompt_ids, params, use_tqdm=False)
            reference = [list(o.outputs[0].token_ids) for o in outs]
        predicted = [stepwise_argmax(llm, p, r) for p, r in zip(prompt_ids, reference)]
        same = sum(a == b for pred, ref in zip(predicted, reference) for a, b in zip(pred, ref))
        rows[weights] = {
            "teacher_forced_agreement": round(same / sum(map(len, reference)), 4),
            "perplexity": round(perplexity(llm, text_ids), 4),
            "weights_bytes": llm.memory_stats().weights_bytes,
        }
        del llm
        gc.collect()
    dense, native = rows["dense"], rows["native"]
    return {
        "model": label, "formats": formats,
        "teacher_forced_agreement": native["teacher_forced_agreement"],
        "perplexity_fp32": dense["perplexity"], "perplexity_native": native["perplexity"],
        "perplexity_change": round(native["perplexity"] / dense["perplexity"] - 1, 5),
        "fp32_self_agreement": dense["teacher_forced_agreement"],
        "weights_bytes_native": native["weights_bytes"],
        "weights_bytes_fp32": dense["weights_bytes"],
        "wall_s": round(time.perf_counter() - start, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--formats", default=",".join(FORMATS),
                        help="32-value formats to requantize SmolLM2's layers to")
    parser.add_argument("--gemma", action="store_true", help="add Gemma 3 270M Q4_K_M's row")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(2)
    results = [measure(bundled_model_path(), "SmolLM2-135M as shipped", "Q4_1 layers, Q8_0 head")]
    print(json.dumps(results[-1]), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in filter(None, args.formats.split(",")):
            path = Path(tmp) / f"smollm2-{name}.gguf"
            requantize(bundled_model_path(), path, name)
            results.append(measure(path, "SmolLM2-135M requantized", f"{name} layers, Q8_0 head"))
            print(json.dumps(results[-1]), flush=True)
            path.unlink()
    if args.gemma:
        results.append(measure(packaged_gemma3_path(), "Gemma 3 270M Q4_K_M",
                               "Q4_K, Q6_K, Q5_0, Q8_0"))
        print(json.dumps(results[-1]), flush=True)
    args.out.write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_label(),
        "prompts": 16, "max_tokens": MAX_TOKENS, "chunk": CHUNK, "rows": results,
    }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
