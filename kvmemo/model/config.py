"""ModelArchConfig: the architecture hyperparameters of a Llama-family decoder.

Built once from an HF config.json dict or from GGUF metadata; frozen and validated on construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")
# HF `architectures[0]` -> our architecture name.
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
}
# "default" is plain RoPE; "llama3" is Llama 3.1's frequency-dependent scaling; "freq_factors" is
# llama.cpp's form of the same thing (a per-frequency divisor tensor `rope_freqs` in the GGUF).
SUPPORTED_ROPE_TYPES = ("default", "llama3", "freq_factors")


@dataclass(frozen=True)
class ModelArchConfig:
    """Owns the shape and numerics of the model; promises head_dim * heads divides consistently."""

    architecture: str  # "llama" | "qwen2" | "mistral"
    vocab_size: int  # rows of the embedding and of lm_head
    hidden_size: int  # residual stream width
    intermediate_size: int  # gated MLP inner width
    num_hidden_layers: int  # decoder blocks
    num_attention_heads: int  # query heads
    num_key_value_heads: int  # K/V heads (GQA when < num_attention_heads)
    head_dim: int  # per-head width (not always hidden_size // num_attention_heads)
    rms_norm_eps: float  # epsilon of every RMSNorm
    rope_theta: float  # RoPE base frequency
    rope_scaling: dict[str, Any] | None  # None (plain RoPE) or {"rope_type": "llama3", ...}
    max_position_embeddings: int  # trained context length (sizes the initial RoPE cache)
    tie_word_embeddings: bool  # lm_head shares the embedding matrix
    attention_bias: bool  # q/k/v carry a bias (qwen2 always; llama: o_proj too)
    bos_token_id: int | None  # begin-of-sequence token, if the model has one
    eos_token_ids: tuple[int, ...]  # every token id that ends generation
    sliding_window: int | None = None  # mistral's attention window; None = full attention

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope_scaling type {rope_type!r}; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelArchConfig:
        """Build from a config.json dict (4.x `rope_scaling` or 5.x `rope_parameters` style)."""
        archs = config.get("architectures") or []
        arch_name = archs[0] if archs else None
        if arch_name is None:  # configs built in code (not saved) may only carry model_type
            by_type = {v: k for k, v in HF_ARCHITECTURES.items()}
            arch_name = by_type.get(config.get("model_type", ""), config.get("model_type"))
        if arch_name not in HF_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch_name!r} in config.json; "
                f"supported: {', '.join(HF_ARCHITECTURES)}"
            )
        architecture = HF_ARCHITECTURES[arch_name]
        if config.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported; allowed: mlp_bias=False")
        num_heads = int(config["num_attention_heads"])
        rope_theta, rope_scaling = _hf_rope(config)
        eos = config.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        attention_bias = architecture == "qwen2" or bool(config.get("attention_bias", False))
        use_window = config.get("use_sliding_window", architecture == "mistral")
        return cls(
            architecture=architecture,
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // num_heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=config.get("sliding_window") if use_window else None,
        )

    @classmethod
    def from_gguf_metadata(
        cls,
        metadata: dict[str, Any],
        *,
        vocab_size: int,
        tie_word_embeddings: bool,
        rope_freq_factors: list[float] | None = None,
    ) -> ModelArchConfig:
        """Build from GGUF key/values (`general.architecture`, `{arch}.*`, `tokenizer.ggml.*`).

        vocab_size and tie_word_embeddings come from the tensors (token_embd rows, absence of
        `output.weight`), which llama.cpp treats as the source of truth.
        """
        gguf_arch = metadata.get("general.architecture")
        architecture = gguf_arch
        # llama.cpp converts Mistral to the llama architecture; transformers renames it back.
        if gguf_arch == "llama" and "mistral" in str(metadata.get("general.name", "")).lower():
            architecture = "mistral"
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported GGUF general.architecture {gguf_arch!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )

        def get(key: str, default: Any = None) -> Any:
            value = metadata.get(f"{gguf_arch}.{key}", default)
            if value is None:
                raise ValueError(f"GGUF metadata lacks required key {gguf_arch}.{key}")
            return value

        hidden = int(get("embedding_length"))
        num_heads = int(get("attention.head_count"))
        eos_ids = [metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot")]
        rope_scaling = None
        if rope_freq_factors is not None:
            rope_scaling = {"rope_type": "freq_factors", "freq_factors": list(rope_freq_factors)}
        window = metadata.get(f"{gguf_arch}.attention.sliding_window")
        return cls(
            architecture=architecture,
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_hidden_layers=int(get("block_count")),
            num_attention_heads=num_heads,
            num_key_value_heads=int(get("attention.head_count_kv", num_heads)),
            head_dim=int(get("attention.key_length", hidden // num_heads)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(get("context_length", 2048)),
            tie_word_embeddings=tie_word_embeddings,
            attention_bias=architecture == "qwen2",
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos_ids if i is not None)),
            sliding_window=int(window) if window is not None else None,
        )


def _hf_rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None) from either transformers config generation."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_theta = float(params.pop("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return rope_theta, None
    params["rope_type"] = rope_type
    params.pop("type", None)
    return rope_theta, params
