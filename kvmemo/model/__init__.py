"""Models: GGUF and safetensors loading, the architectures (Llama family, Gemma 3, LLaVA), their
layers and linear kernels, and the C kernels under them, in four rooms whose imports point one
way (a test enforces it):

    loading/  ->  models/  ->  layers/  ->  kernels/        (config.py: shared by all four)

Never imports engine/, kv/ or attention/: attention arrives as a callable (AttentionFn).
CausalLM below is what the engine's model runner may call on a loaded model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from kvmemo.model.layers.basic import AttentionFn


class CausalLM(Protocol):
    """A loaded model as the runner sees it (LlamaForCausalLM, Gemma3ForCausalLM, LLaVA)."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn,
                 inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T], positions [T] -> final-normed hidden states [T, hidden] fp32."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> fp32 logits [N, vocab] (the exact head)."""
        ...

    def sampling_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits for rows sampled at a temperature that return no logprobs."""
        ...

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The fp32 argmax per row (-1: compute in full), or None without a greedy head."""
        ...

    @property
    def has_sampling_head(self) -> bool:
        """sampling_logits reads another head than compute_logits."""
        ...
