"""CLIP-style vision tower: patch conv + class token + learned positions, pre-layernorm, encoder.

Invariant: encode() returns the hidden states after `feature_layer` (HF indexing: 0 = the
pre-layernormed embeddings, -1 = the last layer), numerically equal to transformers'
CLIPVisionModel hidden_states in fp32. Layers past the selected one are never built.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def activation(name: str):
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


@dataclass(frozen=True)
class VisionConfig:
    """The CLIP vision tower's shape (HF CLIPVisionConfig keys)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int  # square input side, pixels
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size != 0:
            raise ValueError(
                f"vision image_size {self.image_size} must be a multiple of "
                f"patch_size {self.patch_size}"
            )
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError("vision hidden_size must be a multiple of num_attention_heads")
        activation(self.hidden_act)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> VisionConfig:
        model_type = raw.get("model_type", "clip_vision_model")
        if model_type != "clip_vision_model":
            raise ValueError(
                f"unsupported vision_config.model_type {model_type!r}; supported: clip_vision_model"
            )
        return cls(
            hidden_size=int(raw.get("hidden_size", 768)),
            intermediate_size=int(raw.get("intermediate_size", 3072)),
            num_hidden_layers=int(raw.get("num_hidden_layers", 12)),
            num_attention_heads=int(raw.get("num_attention_heads", 12)),
            image_size=int(raw.get("image_size", 224)),
            patch_size=int(raw.get("patch_size", 32)),
            num_channels=int(raw.get("num_channels", 3)),
            layer_norm_eps=float(raw.get("layer_norm_eps", 1e-5)),
            hidden_act=str(raw.get("hidden_act", "quick_gelu")),
        )


class VisionEncoderLayer(nn.Module):
    """Pre-norm block: h += out_proj(attn(ln1(h))); h += fc2(act(fc1(ln2(h)))). No mask."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.layer_norm1 = nn.LayerNorm(dim, eps=config.layer_norm_eps)
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)
        self.layer_norm2 = nn.LayerNorm(dim, eps=config.layer_norm_eps)
        self.fc1 = nn.Linear(dim, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, dim)
        self.act = activation(config.hidden_act)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = hidden.shape
        x = self.layer_norm1(hidden)

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, seq, self.num_heads, dim // self.num_heads).transpose(1, 2)

        q, k, v = (
            heads(self.q_proj(x)),
            heads(self.k_proj(x)),
            heads(self.v_proj(x)),
        )  # [B, H, S, D]
        attn = F.scaled_dot_product_attention(q, k, v)  # full (bidirectional) attention
        hidden = hidden + self.out_proj(attn.transpose(1, 2).reshape(batch, seq, dim))
        return hidden + self.fc2(self.act(self.fc1(self.layer_norm2(hidden))))


class VisionTower(nn.Module):
    """Owns the CLIP embeddings, pre-layernorm and the encoder layers up to the selected one."""

    def __init__(self, config: VisionConfig, feature_layer: int) -> None:
        super().__init__()
        num_layers = config.num_hidden_layers
        index = feature_layer if feature_layer >= 0 else num_layers + 1 + feature_layer
        if not 0 <= index <= num_layers:
            raise ValueError(
                f"vision_feature_layer {feature_layer} is outside [-{num_layers + 1}, {num_layers}]"
            )
        self.config = config
        self.num_layers_used = index  # hidden_states[index] is the output of layer index - 1
        dim = config.hidden_size
        self.class_embedding = nn.Parameter(torch.empty(dim))
        self.patch_embedding = nn.Conv2d(
            config.num_channels,
            dim,
            kernel_size=config.patch_size,
            stride=config.patch_size,
            bias=False,
        )
        self.position_embedding = nn.Embedding(
            config.num_patches + 1, dim, _weight=torch.empty(config.num_patches + 1, dim)
        )
        self.pre_layrnorm = nn.LayerNorm(dim, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(VisionEncoderLayer(config) for _ in range(self.num_layers_used))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C, S, S] -> the selected layer's hidden states [N, 1 + patches, dim]."""
        size = self.config.image_size
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[-2:]) != (size, size):
            raise ValueError(
                f"pixel_values must be [N, C, {size}, {size}], got {tuple(pixel_values.shape)}"
            )
        patches = self.patch_embedding(
            pixel_values.to(self.patch_embedding.weight.dtype)
        )  # [N, dim, g, g]
        patches = patches.flatten(2).transpose(1, 2)  # [N, patches, dim]
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)  # [N, 1, dim]
        hidden = (
            torch.cat([cls, patches], dim=1) + self.position_embedding.weight
        )  # [N, 1 + patches, dim]
        hidden = self.pre_layrnorm(hidden)
        for layer in self.layers:
            hidden = layer(hidden)
        return hidden

    def hf_weight_map(self, prefix: str) -> dict[str, str]:
        """Our parameter name -> HF name under `prefix` (e.g. 'vision_tower.vision_model.')."""
        names = {
            "class_embedding": "embeddings.class_embedding",
            "patch_embedding.weight": "embeddings.patch_embedding.weight",
            "position_embedding.weight": "embeddings.position_embedding.weight",
            "pre_layrnorm.weight": "pre_layrnorm.weight",
            "pre_layrnorm.bias": "pre_layrnorm.bias",
        }
        for i in range(self.num_layers_used):
            for ours, theirs in (
                ("layer_norm1", "layer_norm1"),
                ("layer_norm2", "layer_norm2"),
                ("q_proj", "self_attn.q_proj"),
                ("k_proj", "self_attn.k_proj"),
                ("v_proj", "self_attn.v_proj"),
                ("out_proj", "self_attn.out_proj"),
                ("fc1", "mlp.fc1"),
                ("fc2", "mlp.fc2"),
            ):
                for kind in ("weight", "bias"):
                    names[f"layers.{i}.{ours}.{kind}"] = f"encoder.layers.{i}.{theirs}.{kind}"
        return {ours: prefix + theirs for ours, theirs in names.items()}


def adopt_weights(
    module: nn.Module,
    name_map: dict[str, str],
    state_dict: Mapping[str, torch.Tensor],
    *,
    dtype: torch.dtype,
    device: str | torch.device,
) -> None:
    """Replace every parameter of a meta-device `module` by state_dict[name_map[name]].

    Raises ValueError naming missing keys or mismatched shapes.
    """
    params = dict(module.named_parameters())
    missing = sorted(name_map[n] for n in params if name_map.get(n) not in state_dict)
    if missing:
        raise ValueError(f"checkpoint lacks {missing[:6]}{'...' if len(missing) > 6 else ''}")
    for name, param in params.items():
        weight = state_dict[name_map[name]]
        if tuple(weight.shape) != tuple(param.shape):
            raise ValueError(
                f"{name_map[name]} has shape {tuple(weight.shape)}, expected {tuple(param.shape)}"
            )
        owner, _, attr = name.rpartition(".")
        target = module.get_submodule(owner) if owner else module
        setattr(
            target,
            attr,
            nn.Parameter(weight.to(device=device, dtype=dtype).contiguous(), requires_grad=False),
        )
