"""GGUF reader: dequantize every tensor to fp32 torch and rename llama.cpp names to HF names.

Invariant: the returned state dict is in HF layout, i.e. llama.cpp's Q/K row permutation is undone
exactly as transformers' GGUF loader does (only for GGUF `general.architecture == "llama"`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize

from kvmemo.model.config import SUPPORTED_ARCHITECTURES, ModelArchConfig

# F32/F16 are plain views; every other type is whatever gguf.quants implements (Q4_0..Q8_0,
# K-quants, IQ*, BF16, ...). Read from the package so an upgrade widens support automatically.
try:
    from gguf.quants import _type_traits as _GGUF_TRAITS  # private, but the only registry
except ImportError:  # pragma: no cover - older gguf packages
    _GGUF_TRAITS = {}
SUPPORTED_QUANT_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    {GGMLQuantizationType.F32, GGMLQuantizationType.F16, *_GGUF_TRAITS}
)

# Per-layer llama.cpp name -> HF name (weights and biases alike).
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_ROPE_FREQS = "rope_freqs.weight"


@dataclass
class GGUFCheckpoint:
    """What a GGUF file holds, in HF terms."""

    state_dict: dict[str, torch.Tensor]  # HF names -> fp32 tensors, HF (out, in) layout
    arch_config: ModelArchConfig
    chat_template: str | None  # tokenizer.chat_template, verbatim
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    metadata: dict[str, Any] = field(repr=False)  # every scalar/string key (arrays skipped)


def supported_quant_type_names() -> list[str]:
    return sorted(t.name for t in SUPPORTED_QUANT_TYPES)


def gguf_to_hf_name(name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; unknown -> ValueError."""
    if m := _LAYER_RE.match(name):
        layer, part, kind = m.groups()
        if part in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    else:
        stem, _, kind = name.rpartition(".")
        if stem in _GLOBAL_NAMES and kind in ("weight", "bias"):
            return f"{_GLOBAL_NAMES[stem]}.{kind}"
    raise ValueError(
        f"unknown GGUF tensor {name!r}; expected token_embd, output_norm, output, rope_freqs or "
        f"blk.N.{{{','.join(_LAYER_NAMES)}}}.weight/bias"
    )


def reverse_llama_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's `permute` of q_proj/k_proj rows (weight [out, in] or bias [out]).

    llama.cpp stores each head's rotary pairs interleaved (x0,y0,x1,y1..); HF uses rotate-half
    halves (x0,x1,..,y0,y1,..). Same as transformers' LlamaTensorProcessor._reverse_permute_weights.
    """
    head_half = weight.shape[0] // num_heads // 2
    w = weight.reshape(num_heads, head_half, 2, *weight.shape[1:])  # [H, D/2, 2, (in)]
    return w.transpose(1, 2).reshape(weight.shape)  # [H, 2, D/2, (in)] -> [out, (in)]


def llama_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The permutation convert_hf_to_gguf applies (HF -> llama.cpp); for tests and writers."""
    head_dim = weight.shape[0] // num_heads
    w = weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:])  # [H, 2, D/2, (in)]
    return w.transpose(1, 2).reshape(weight.shape)  # [H, D/2, 2, (in)] -> [out, (in)]


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Scalar and string fields as Python values; arrays only for short non-vocab lists."""
    metadata: dict[str, Any] = {}
    for key, f in reader.fields.items():
        if f.types and f.types[0] == GGUFValueType.ARRAY and len(f.data) > 64:
            continue  # tokens / merges / scores: the tokenizer reads those itself
        metadata[key] = f.contents()
    return metadata


def dequantize_tensor(name: str, data: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    """One tensor's raw GGUF data -> fp32 torch tensor in numpy (row-major, HF) shape."""
    if qtype not in SUPPORTED_QUANT_TYPES:
        raise ValueError(
            f"GGUF tensor {name!r} has unsupported quantization type {qtype.name}; "
            f"supported: {', '.join(supported_quant_type_names())}"
        )
    array = dequantize(data, qtype)
    # F32 returns a read-only view into the memmap: copy so the file can close.
    return torch.from_numpy(np.array(array, dtype=np.float32, copy=True))


def read_gguf(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(metadata, {llama.cpp tensor name: fp32 tensor}) with no renaming or un-permuting.

    Raises:
        FileNotFoundError: the path does not exist.
        ValueError: not a GGUF file, or a tensor of an unsupported quantization type.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        reader = GGUFReader(path, "r")
    except (ValueError, OSError) as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e
    tensors = {t.name: dequantize_tensor(t.name, t.data, t.tensor_type) for t in reader.tensors}
    return read_metadata(reader), tensors


def load_gguf(path: str | os.PathLike[str]) -> GGUFCheckpoint:
    """Read, dequantize and rename every tensor of a GGUF file into HF layout.

    Raises:
        FileNotFoundError: the path does not exist.
        ValueError: unsupported architecture, quantization type or tensor name.
    """
    metadata, tensors = read_gguf(path)
    gguf_arch = metadata.get("general.architecture")
    if gguf_arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF general.architecture {gguf_arch!r} in {path}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    rope_freqs = tensors.pop(_ROPE_FREQS, None)
    state_dict = {gguf_to_hf_name(name): weight for name, weight in tensors.items()}
    rope_freq_factors = rope_freqs.tolist() if rope_freqs is not None else None

    embed = state_dict.get("model.embed_tokens.weight")
    if embed is None:
        raise ValueError(f"{path} has no token_embd.weight tensor")
    arch_config = ModelArchConfig.from_gguf_metadata(
        metadata,
        vocab_size=embed.shape[0],
        tie_word_embeddings="lm_head.weight" not in state_dict,
        rope_freq_factors=rope_freq_factors,
    )
    if gguf_arch == "llama":  # qwen2 etc. are stored unpermuted by convert_hf_to_gguf
        for hf_name in list(state_dict):
            if ".q_proj." in hf_name:
                heads = arch_config.num_attention_heads
            elif ".k_proj." in hf_name:
                heads = arch_config.num_key_value_heads
            else:
                continue
            state_dict[hf_name] = reverse_llama_permute(state_dict[hf_name], heads)

    return GGUFCheckpoint(
        state_dict=state_dict,
        arch_config=arch_config,
        chat_template=metadata.get("tokenizer.chat_template"),
        bos_token_id=arch_config.bos_token_id,
        eos_token_ids=arch_config.eos_token_ids,
        metadata=metadata,
    )
