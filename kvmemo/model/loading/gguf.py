"""GGUF reader: every tensor as fp32 torch (or, with native=True, linear weights and the embedding
table kept at their GGUF bits as QuantizedWeights), renamed from llama.cpp names to HF names.

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
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quant_shape_from_byte_shape

from kvmemo.model.config import SUPPORTED_ARCHITECTURES, ModelArchConfig
from kvmemo.model.kernels.quant_linear import NATIVE_TYPES, QuantizedWeight, dequantize_rows_into
from kvmemo.model.loading.gguf_header import GGUFFile, TensorInfo
from kvmemo.model.models.registry import LLAMA_GGUF_LAYER_NAMES, architecture_spec

# F32/F16 are plain views; every other type is whatever gguf.quants implements (Q4_0..Q8_0,
# K-quants, IQ*, BF16, ...). Read from the package so an upgrade widens support automatically.
try:
    from gguf.quants import _type_traits as _GGUF_TRAITS  # private, but the only registry
except ImportError:  # pragma: no cover - older gguf packages
    _GGUF_TRAITS = {}
SUPPORTED_QUANT_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    {GGMLQuantizationType.F32, GGMLQuantizationType.F16, *_GGUF_TRAITS}
)

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_ROPE_FREQS = "rope_freqs.weight"
# Longer metadata arrays (tokens / merges / scores) are skipped: the tokenizer reads those itself.
_MAX_METADATA_ARRAY_LEN = 64
# llama.cpp tensors that LlamaForCausalLM fuses (qkv_proj, gate_up_proj), in its concatenation
# order. Only a layout hint: the model falls back to torch.cat for tensors that are not adjacent.
_FUSED_GROUPS = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"))
_CHUNK_VALUES = 1 << 16  # per step; keeps temporaries small enough for malloc to reuse


# llama.cpp tensors that are a linear layer's weight (or the embedding table, the tied head):
# what native weights keep at their GGUF bits.
LINEAR_PARTS = frozenset(
    {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}
)
LINEAR_GLOBALS = frozenset({"token_embd.weight", "output.weight"})


@dataclass
class GGUFCheckpoint:
    """What a GGUF file holds, in HF terms."""

    # HF names -> fp32 tensors, HF (out, in) layout; with native=True, linear weights of a type
    # the kernels read are QuantizedWeights (views of the mapped file) instead.
    state_dict: dict[str, torch.Tensor | QuantizedWeight]
    arch_config: ModelArchConfig
    chat_template: str | None  # tokenizer.chat_template, verbatim
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    metadata: dict[str, Any] = field(repr=False)  # every key except arrays of > 64 items


def supported_quant_type_names() -> list[str]:
    return sorted(t.name for t in SUPPORTED_QUANT_TYPES)


def gguf_to_hf_name(name: str, layer_names: dict[str, str] = LLAMA_GGUF_LAYER_NAMES) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; unknown -> ValueError.

    layer_names is the architecture's per-layer map (registry.ArchitectureSpec.gguf_layer_names).
    """
    if m := _LAYER_RE.match(name):
        layer, part, kind = m.groups()
        if part in layer_names:
            return f"model.layers.{layer}.{layer_names[part]}.{kind}"
    else:
        stem, _, kind = name.rpartition(".")
        if stem in _GLOBAL_NAMES and kind in ("weight", "bias"):
            return f"{_GLOBAL_NAMES[stem]}.{kind}"
    raise ValueError(
        f"unknown GGUF tensor {name!r}; expected token_embd, output_norm, output, rope_freqs or "
        f"blk.N.{{{','.join(layer_names)}}}.weight/bias"
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


def dequantize_tensor(name: str, data: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    """One tensor's raw GGUF data (uint8 rows) -> fp32 torch tensor.

    The tensor has the numpy (row-major, HF) shape.
    """
    out = torch.empty(quant_shape_from_byte_shape(data.shape, qtype), dtype=torch.float32)
    dequantize_into(name, out, data, qtype)
    return out


def dequantize_into(
    name: str,
    out: torch.Tensor,
    data: np.ndarray,
    qtype: GGMLQuantizationType,
    *,
    unpermute_heads: int | None = None,
) -> None:
    """Dequantize raw GGUF data into `out` (fp32, contiguous, the tensor's shape), chunk by chunk.

    Writing in place lets fused parameters be filled without a later concatenation copy;
    unpermute_heads applies reverse_llama_permute on the way.
    """
    if qtype not in SUPPORTED_QUANT_TYPES:
        raise ValueError(
            f"GGUF tensor {name!r} has unsupported quantization type {qtype.name}; "
            f"supported: {', '.join(supported_quant_type_names())}"
        )
    if unpermute_heads is not None:
        out.copy_(reverse_llama_permute(dequantize_tensor(name, data, qtype), unpermute_heads))
        return
    if out.numel() and dequantize_rows_into(data, qtype, out):
        return
    quant = _GGUF_TRAITS.get(qtype)
    if quant is not None:
        quant.init_grid()  # lookup tables of the IQ types; a no-op for the others
    rows = data.reshape(-1, data.shape[-1])  # [rows, bytes per row]
    dst = out.numpy().reshape(rows.shape[0], -1)  # [rows, values per row]
    step = max(1, _CHUNK_VALUES // max(1, dst.shape[1]))
    for i in range(0, rows.shape[0], step):
        # Same per-block arithmetic as gguf.quants.dequantize, without its 16-row grouping.
        chunk = rows[i : i + step]
        dst[i : i + step] = quant.dequantize_rows(chunk) if quant else dequantize(chunk, qtype)


def _open(path: str | os.PathLike[str]) -> GGUFFile:
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return GGUFFile(path, max_array_len=_MAX_METADATA_ARRAY_LEN)
    except (ValueError, OSError) as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


def read_gguf(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(metadata, {llama.cpp tensor name: fp32 tensor}) with no renaming or un-permuting.

    Raises:
        FileNotFoundError: the path does not exist.
        ValueError: not a GGUF file, or a tensor of an unsupported quantization type.
    """
    gguf_file = _open(path)
    tensors = {
        t.name: dequantize_tensor(t.name, gguf_file.raw(t), t.qtype)
        for t in gguf_file.header.tensors
    }
    return gguf_file.header.metadata, tensors


def load_gguf(path: str | os.PathLike[str], *, native: bool = False) -> GGUFCheckpoint:
    """Read, dequantize and rename every tensor of a GGUF file into HF layout.

    Tensors that LlamaForCausalLM fuses (q/k/v, gate/up) are dequantized back to back into one
    buffer per layer, so the state dict holds adjacent views that the model adopts without a copy.
    native=True keeps every linear weight (and the embedding table) of a quantized or 16-bit
    type as a QuantizedWeight over the memory-mapped file instead; F32 ones stay dense.

    Raises:
        FileNotFoundError: the path does not exist.
        ValueError: unsupported architecture, quantization type or tensor name.
    """
    gguf_file = _open(path)
    metadata = gguf_file.header.metadata
    gguf_arch = metadata.get("general.architecture")
    if gguf_arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF general.architecture {gguf_arch!r} in {path}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    spec = architecture_spec(gguf_arch)
    infos = {t.name: t for t in gguf_file.header.tensors}
    rope_freqs = infos.pop(_ROPE_FREQS, None)
    # Unknown names raise here.
    hf_names = {name: gguf_to_hf_name(name, spec.gguf_layer_names) for name in infos}
    rope_freq_factors = None
    if rope_freqs is not None:
        raw = gguf_file.raw(rope_freqs)
        rope_freq_factors = dequantize_tensor(_ROPE_FREQS, raw, rope_freqs.qtype).tolist()

    embed = infos.get("token_embd.weight")
    if embed is None:
        raise ValueError(f"{path} has no token_embd.weight tensor")
    arch_config = ModelArchConfig.from_gguf_metadata(
        metadata,
        vocab_size=embed.shape[0],
        tie_word_embeddings="output.weight" not in infos,
        rope_freq_factors=rope_freq_factors,
    )
    # qwen2 etc. are stored unpermuted by convert_hf_to_gguf; llama's q/k rows are permuted.
    heads = {}
    if spec.gguf_permutes_qk:
        heads = {
            "attn_q": arch_config.num_attention_heads,
            "attn_k": arch_config.num_key_value_heads,
        }

    state_dict: dict[str, torch.Tensor | QuantizedWeight] = {}
    if native:
        for name, info in list(infos.items()):
            part = m.group(2) if (m := _LAYER_RE.match(name)) else None
            is_linear = part in LINEAR_PARTS or name in LINEAR_GLOBALS
            # A type the kernels do not read (Q2_K, IQ*, ...) loads dense like F32; a model
            # may mix both (NativeLinear takes dense parts).
            if is_linear and info.qtype in NATIVE_TYPES:
                raw = gguf_file.raw(info)
                if part in heads:  # llama.cpp's q/k row order: whole rows move, blocks stay
                    order = reverse_llama_permute(torch.arange(raw.shape[0]), heads[part])
                    raw = raw[order.numpy()]
                state_dict[hf_names[name]] = QuantizedWeight.from_numpy(name, info.qtype, raw)
                del infos[name]
    for name, out in _allocate(infos).items():
        info = infos[name]
        part = m.group(2) if (m := _LAYER_RE.match(name)) else None
        unpermute = heads.get(part) if part else None
        dequantize_into(name, out, gguf_file.raw(info), info.qtype, unpermute_heads=unpermute)
        if spec.gguf_norm_offset and name.endswith("norm.weight"):
            out += spec.gguf_norm_offset  # as transformers' loader: the file holds 1 + w
        state_dict[hf_names[name]] = out

    return GGUFCheckpoint(
        state_dict=state_dict,
        arch_config=arch_config,
        chat_template=metadata.get("tokenizer.chat_template"),
        bos_token_id=arch_config.bos_token_id,
        eos_token_ids=arch_config.eos_token_ids,
        metadata=metadata,
    )


def _allocate(infos: dict[str, TensorInfo]) -> dict[str, torch.Tensor]:
    """Uninitialised fp32 outputs in file order; each fused group is views of one buffer."""
    groups: dict[tuple[str, int, str], list[str]] = {}  # (layer, group, weight|bias) -> names
    for name in infos:
        m = _LAYER_RE.match(name)
        for index, members in enumerate(_FUSED_GROUPS):
            if m and m.group(2) in members:
                groups.setdefault((m.group(1), index, m.group(3)), []).append(name)

    outputs: dict[str, torch.Tensor] = {}
    for (_, index, _), names in groups.items():
        names.sort(key=lambda n: _FUSED_GROUPS[index].index(n.split(".")[2]))
        shapes = [infos[n].shape for n in names]
        if len({shape[1:] for shape in shapes}) != 1:
            continue  # rows of different widths cannot be stacked; allocated one by one below
        buffer = torch.empty(sum(s[0] for s in shapes), *shapes[0][1:], dtype=torch.float32)
        outputs.update(zip(names, buffer.split([s[0] for s in shapes])))
    return {
        name: outputs[name] if name in outputs else torch.empty(info.shape, dtype=torch.float32)
        for name, info in infos.items()
    }
