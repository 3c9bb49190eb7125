"""LLaVA: CLIP vision tower -> projector (linear, act, linear) -> Llama-family language model.

Invariant: encode_images() gives, per image, exactly `num_image_tokens` rows of language-model
width; the language model reads them in place of the image's placeholder token embeddings, so a
prompt's KV depends on (tokens, image features) exactly as in transformers'
LlavaForConditionalGeneration.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvmemo.model.config import ModelArchConfig
from kvmemo.model.layers.basic import AttentionFn
from kvmemo.model.layers.linear import KernelChoice
from kvmemo.model.models.llama import LlamaForCausalLM
from kvmemo.model.models.vision import VisionConfig, VisionTower, activation, adopt_weights

# Checkpoint key prefixes of every transformers generation -> one canonical form. LLaVA-1.5
# (llava-hf/*) and transformers 5 save "language_model.model.*"; transformers 4.52-4.57 save
# "model.language_model.*"; the vision tower sits under "vision_model." in CLIPVisionModel form.
_PREFIXES = (
    ("model.language_model.", "language_model.model."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("lm_head.", "language_model.lm_head."),
    ("vision_tower.vision_model.", "vision_tower."),
)


# LlamaConfig's defaults: llava-hf's LLaVA-1.5 configs list only what differs from them (their
# text_config has no hidden_size, for one).
_LLAMA_DEFAULTS = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@dataclass(frozen=True)
class LlavaConfig:
    """What a LLaVA checkpoint's config.json says beyond its text and vision configs."""

    text: ModelArchConfig
    vision: VisionConfig
    image_token_id: int  # the placeholder token that image features replace
    feature_layer: int  # which vision hidden state feeds the projector (HF indexing)
    feature_select_strategy: str  # "default" drops the class token, "full" keeps it
    projector_act: str
    projector_bias: bool

    @property
    def num_image_tokens(self) -> int:
        extra = 1 if self.feature_select_strategy == "full" else 0
        return self.vision.num_patches + extra

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> LlavaConfig:
        if raw.get("model_type") != "llava":
            raise ValueError(f"expected model_type 'llava', got {raw.get('model_type')!r}")
        text_raw = dict(raw.get("text_config") or {})
        text_raw.setdefault("model_type", "llama")
        if text_raw["model_type"] == "llama":
            text_raw = {**_LLAMA_DEFAULTS, **text_raw}
        if "tie_word_embeddings" in raw:
            text_raw["tie_word_embeddings"] = raw["tie_word_embeddings"]
        layer = raw.get("vision_feature_layer", -2)
        if not isinstance(layer, int):
            raise ValueError(
                f"vision_feature_layer must be one integer, got {layer!r} (lists unsupported)"
            )
        strategy = raw.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ValueError(
                f"vision_feature_select_strategy must be 'default' or 'full', got {strategy!r}"
            )
        token = raw.get("image_token_id", raw.get("image_token_index"))
        if token is None:
            raise ValueError("config.json lacks image_token_id (or image_token_index)")
        act = str(raw.get("projector_hidden_act", "gelu"))
        activation(act)
        return cls(
            text=ModelArchConfig.from_hf_config(text_raw),
            vision=VisionConfig.from_hf(dict(raw.get("vision_config") or {})),
            image_token_id=int(token),
            feature_layer=layer,
            feature_select_strategy=strategy,
            projector_act=act,
            projector_bias=bool(raw.get("multimodal_projector_bias", True)),
        )


def canonical_key(name: str) -> str:
    for old, new in _PREFIXES:  # in order: a 4.52 vision key needs two of the rules
        if name.startswith(old):
            name = new + name[len(old) :]
    return name


class LlavaForConditionalGeneration(nn.Module):
    """Owns the vision tower, the projector and the language model (a LlamaForCausalLM)."""

    def __init__(self, config: LlavaConfig, language_model: LlamaForCausalLM) -> None:
        super().__init__()
        self.config = config
        self.language_model = language_model
        self.vision_tower = VisionTower(config.vision, config.feature_layer)
        text_dim, vision_dim = config.text.hidden_size, config.vision.hidden_size
        self.linear_1 = nn.Linear(vision_dim, text_dim, bias=config.projector_bias)
        self.linear_2 = nn.Linear(text_dim, text_dim, bias=config.projector_bias)
        self.act = activation(config.projector_act)

    @classmethod
    def from_state_dict(
        cls,
        config: LlavaConfig,
        state_dict: Mapping[str, torch.Tensor],
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> LlavaForConditionalGeneration:
        """Adopt an HF LLaVA state dict (any of the key layouts in _PREFIXES)."""
        canonical = {canonical_key(k): v for k, v in state_dict.items()}
        text_sd = {
            k.removeprefix("language_model."): v
            for k, v in canonical.items()
            if k.startswith("language_model.")
        }
        language_model = LlamaForCausalLM.from_state_dict(
            config.text, text_sd, dtype=dtype, device=device
        )
        with torch.device("meta"):
            model = cls(config, language_model)
        adopt_weights(
            model.vision_tower,
            model.vision_tower.hf_weight_map("vision_tower."),
            canonical,
            dtype=dtype,
            device=device,
        )
        for layer in ("linear_1", "linear_2"):
            kinds = ("weight", "bias") if config.projector_bias else ("weight",)
            adopt_weights(
                getattr(model, layer),
                {kind: f"multi_modal_projector.{layer}.{kind}" for kind in kinds},
                canonical, dtype=dtype, device=device,
            )
        return model.eval()

    # ---- the language model's interface, so the runner treats both models alike ------------

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.language_model.embed_tokens

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionFn,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.language_model(input_ids, positions, attention, inputs_embeds=inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.language_model.greedy_tokens(hidden)

    def prepare_linears(self, choice: KernelChoice | None = None) -> KernelChoice:
        return self.language_model.prepare_linears(choice)

    def param_count(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def weight_bytes(self) -> int:
        language = self.language_model.weight_bytes()
        own = sum(
            p.numel() * p.element_size()
            for name, p in self.named_parameters()
            if not name.startswith("language_model.")
        )
        return language + own

    # ---- images ----------------------------------------------------------------------------

    @torch.inference_mode()
    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, 3, S, S] -> image features [N, num_image_tokens, text hidden]."""
        hidden = self.vision_tower(pixel_values)  # [N, 1 + patches, vision dim]
        if self.config.feature_select_strategy == "default":
            hidden = hidden[:, 1:]  # drop the class token
        return self.linear_2(self.act(self.linear_1(hidden)))
