"""ModelArchConfig: the architecture hyperparameters of a decoder (Llama family, Gemma 3).

Built once from an HF config.json dict or from GGUF metadata; frozen and validated on construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral", "gemma3")
# HF `architectures[0]` -> our architecture name.
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
    "Gemma3ForCausalLM": "gemma3",
}
# model_type -> HF architecture, for configs built in code that carry no `architectures`.
_HF_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                   "mistral": "MistralForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
# Gemma 3 defaults where a GGUF (or an older config.json) is silent: transformers'
# Gemma3TextConfig values, which llama.cpp hardcodes too.
GEMMA3_SLIDING_PATTERN = 6  # every 6th layer attends to the full context, the rest slide
GEMMA3_LOCAL_ROPE_THETA = 10_000.0
GEMMA3_QUERY_PRE_ATTN_SCALAR = 256.0
_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
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
    sliding_window: int | None = None  # tokens a sliding layer sees; None = full attention
    # Per layer "full_attention" | "sliding_attention"; None: every layer attends to the full
    # context (a Llama; mistral's window is wider than any context it is run with here).
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None  # RoPE base of sliding layers (Gemma 3); None: same
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power; None: head_dim
    hidden_activation: str = "silu"  # of the gated MLP: "silu" or "gelu_pytorch_tanh"

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
        if self.hidden_activation not in _ACTIVATIONS:
            raise ValueError(
                f"unsupported hidden_activation {self.hidden_activation!r}; "
                f"supported: {', '.join(_ACTIVATIONS)}"
            )
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(
                    f"layer_types has {len(self.layer_types)} entries for "
                    f"{self.num_hidden_layers} layers"
                )
            unknown = set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
            if unknown:
                raise ValueError(
                    f"unknown layer_types {sorted(unknown)}; "
                    f"allowed: {FULL_ATTENTION}, {SLIDING_ATTENTION}"
                )
            if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
                raise ValueError("sliding_attention layers need a sliding_window >= 1")
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

    @property
    def attention_scale(self) -> float:
        """The softmax scale of q.k: query_pre_attn_scalar**-0.5 (Gemma), else head_dim**-0.5."""
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def sliding_layers(self) -> tuple[int, ...]:
        """Indices of the layers that attend to a sliding window (none for a Llama)."""
        types = self.layer_types or ()
        return tuple(i for i, t in enumerate(types) if t == SLIDING_ATTENTION)

    def layer_window(self, layer: int) -> int | None:
        """The window of `layer` in tokens, or None when it attends to the full context."""
        if self.layer_types is not None and self.layer_types[layer] == SLIDING_ATTENTION:
            return self.sliding_window
        return None

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelArchConfig:
        """Build from a config.json dict (4.x `rope_scaling` or 5.x `rope_parameters` style)."""
        archs = config.get("architectures") or []
        arch_name = archs[0] if archs else None
        if arch_name is None:  # configs built in code (not saved) may only carry model_type
            model_type = config.get("model_type", "")
            arch_name = _HF_MODEL_TYPES.get(model_type, model_type)
        if arch_name not in HF_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch_name!r} in config.json; "
                f"supported: {', '.join(HF_ARCHITECTURES)}"
            )
        architecture = HF_ARCHITECTURES[arch_name]
        if config.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported; allowed: mlp_bias=False")
        num_heads = int(config["num_attention_heads"])
        if architecture == "gemma3":
            return _gemma3_from_hf(config)
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
        gemma: dict[str, Any] = {}
        if architecture == "gemma3":  # what the GGUF leaves out, transformers' defaults fill
            if window is None:
                raise ValueError("GGUF metadata lacks required key gemma3.attention.sliding_window")
            num_layers = int(get("block_count"))
            gemma = {
                "layer_types": gemma3_layer_types(num_layers, GEMMA3_SLIDING_PATTERN),
                "rope_local_theta": GEMMA3_LOCAL_ROPE_THETA,
                "query_pre_attn_scalar": GEMMA3_QUERY_PRE_ATTN_SCALAR,
                "hidden_activation": "gelu_pytorch_tanh",
            }
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
            **gemma,
        )


def gemma3_layer_types(num_layers: int, pattern: int) -> tuple[str, ...]:
    """Gemma 3's interleaving: layer i is full when (i + 1) % pattern == 0, else sliding."""
    return tuple(
        FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION for i in range(num_layers)
    )


def _gemma3_from_hf(config: dict[str, Any]) -> ModelArchConfig:
    """A Gemma3TextConfig dict (either rope style: per-layer-type `rope_parameters`, or
    `rope_theta` + `rope_local_base_freq`)."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(key) is not None:
            raise ValueError(f"{key}={config[key]} is not supported; allowed: null (Gemma 3)")
    num_layers = int(config["num_hidden_layers"])
    layer_types = config.get("layer_types") or gemma3_layer_types(
        num_layers, int(config.get("sliding_window_pattern", GEMMA3_SLIDING_PATTERN))
    )
    params = config.get("rope_parameters") or {}
    if FULL_ATTENTION in params:  # transformers 5: one RoPE dict per layer type
        full, local = dict(params[FULL_ATTENTION]), dict(params.get(SLIDING_ATTENTION) or {})
        rope_theta = float(full.pop("rope_theta", 1_000_000.0))
        local_theta = float(local.get("rope_theta", GEMMA3_LOCAL_ROPE_THETA))
        if local.get("rope_type", "default") != "default":
            raise ValueError("sliding layers' rope_type must be 'default' (Gemma 3)")
        rope_type = full.get("rope_type", "default")
        rope_scaling = None if rope_type == "default" else full
    else:
        rope_theta, rope_scaling = _hf_rope(config)
        local_theta = float(config.get("rope_local_base_freq", GEMMA3_LOCAL_ROPE_THETA))
    num_heads = int(config["num_attention_heads"])
    eos = config.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    return ModelArchConfig(
        architecture="gemma3",
        vocab_size=int(config["vocab_size"]),
        hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config["intermediate_size"]),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(config.get("head_dim") or 256),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(config.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
        attention_bias=bool(config.get("attention_bias", False)),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=eos_ids,
        sliding_window=int(config.get("sliding_window") or 4096),
        layer_types=tuple(layer_types),
        rope_local_theta=local_theta,
        query_pre_attn_scalar=float(config.get("query_pre_attn_scalar") or 256),
        hidden_activation=str(config.get("hidden_activation") or "gelu_pytorch_tanh"),
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
