"""The architecture registry: what each supported decoder needs beyond its config, in one place.

Adding an architecture is one entry here (its model class, its GGUF tensor names, the fixes
llama.cpp's converter applied to its weights, its default chat template), not a chain of ifs
across the loaders.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from importlib.resources import files

from kvmemo.model.models.gemma3 import Gemma3ForCausalLM
from kvmemo.model.models.llama import LlamaForCausalLM

# llama.cpp per-layer tensor name -> HF name, for the Llama family (weights and biases alike).
LLAMA_GGUF_LAYER_NAMES = {
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
GEMMA3_GGUF_LAYER_NAMES = {
    **LLAMA_GGUF_LAYER_NAMES,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


@dataclass(frozen=True)
class ArchitectureSpec:
    model_class: type[LlamaForCausalLM]
    gguf_layer_names: dict[str, str]
    # convert_hf_to_gguf stores q/k rows of `llama` interleaved per head; undone at load.
    gguf_permutes_qk: bool = False
    # convert_hf_to_gguf stores Gemma's (1 + w) norms as 1 + w; HF's weights are w.
    gguf_norm_offset: float = 0.0
    chat_template_file: str | None = None  # used when the checkpoint ships no template
    # Tokens that end a turn besides the checkpoint's EOS (HF's generation_config has them).
    extra_eos_tokens: tuple[str, ...] = field(default=())


ARCHITECTURES: dict[str, ArchitectureSpec] = {
    "llama": ArchitectureSpec(LlamaForCausalLM, LLAMA_GGUF_LAYER_NAMES, gguf_permutes_qk=True),
    "mistral": ArchitectureSpec(LlamaForCausalLM, LLAMA_GGUF_LAYER_NAMES, gguf_permutes_qk=True),
    "qwen2": ArchitectureSpec(LlamaForCausalLM, LLAMA_GGUF_LAYER_NAMES),
    "gemma3": ArchitectureSpec(
        Gemma3ForCausalLM,
        GEMMA3_GGUF_LAYER_NAMES,
        gguf_norm_offset=-1.0,
        chat_template_file="gemma3.jinja",
        extra_eos_tokens=("<end_of_turn>",),
    ),
}


def architecture_spec(architecture: str) -> ArchitectureSpec:
    spec = ARCHITECTURES.get(architecture)
    if spec is None:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(ARCHITECTURES)}"
        )
    return spec


@cache
def default_chat_template(architecture: str) -> str | None:
    """The chat template kvmemo ships for `architecture`, or None."""
    name = architecture_spec(architecture).chat_template_file
    if name is None:
        return None
    return files("kvmemo.model.models").joinpath("chat_templates", name).read_text()
