"""Llama-family decoder (llama, mistral, qwen2) over one flattened token batch.

The model knows nothing of sequences or KV caches: per layer it hands RoPE'd q/k and v to the
injected attention callable, which owns both. Projections are fused (qkv, gate_up) at load time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import torch
from torch import nn

from kvmemo.model.config import ModelArchConfig
from kvmemo.model.kernels.quant_linear import QuantizedWeight
from kvmemo.model.layers.basic import (
    AttentionFn,
    FastForward,
    RMSNorm,
    RotaryEmbedding,
)
from kvmemo.model.layers.greedy_head import GreedyHead
from kvmemo.model.layers.linear import KernelChoice, Linear
from kvmemo.model.layers.linear_probe import choose_kernels
from kvmemo.model.layers.native_linear import NativeLinear
from kvmemo.model.models.llama_layer import DecoderLayer


class LlamaForCausalLM(nn.Module):
    """Owns embeddings, layers, final norm and lm_head; promises HF-equal numerics in fp32."""

    head: Linear | NativeLinear  # the lm_head's kernels, bound by prepare_linears

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        self.config = config
        # _weight skips nn.Embedding's normal_ init, which on the meta device imports torch's
        # decompositions (~1 s); weights always come from load_weights / from_state_dict.
        self.embed_tokens = nn.Embedding(
            config.vocab_size,
            config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size),
        )
        self.rotary = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings
        )
        self.layers = nn.ModuleList(
            self.make_layer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = self.make_norm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.linear_choice: KernelChoice | None = None  # set by prepare_linears
        # The forward with its small ops in C (llama_fast.DenseForward), bound from outside when
        # the model fits.
        self.dense_forward: FastForward | None = None
        # Greedy rows' tokens without the full fp32 head (layers/greedy_head.py), bound by
        # prepare_linears.
        self.greedy_head: GreedyHead | None = None
        self._plain_released = False
        # Native weights: parameter name -> its row blocks at their GGUF bits (the parameter
        # itself is an empty placeholder); empty when the weights were dequantized at load.
        self.native_parts: dict[str, list[QuantizedWeight | torch.Tensor]] = {}

    def _prepare_native_linears(self) -> KernelChoice:
        """Every projection reads its GGUF blocks through the quantized kernel (NativeLinear);
        parts stored dense in the file (F32) ride along in the same projection."""

        def native(name: str, bias: torch.Tensor | None = None) -> NativeLinear:
            parts = self.native_parts.get(name)
            if parts is None:  # a weight the file holds in F32 throughout
                parts = [self.get_parameter(name).detach().float()]
            return NativeLinear(parts, bias)

        for i, layer in enumerate(cast("list[DecoderLayer]", self.layers)):
            p = f"layers.{i}."
            layer.qkv = native(p + "qkv_proj.weight", layer.qkv_proj.bias)  # type: ignore[assignment]
            layer.o = native(p + "o_proj.weight", layer.o_proj.bias)  # type: ignore[assignment]
            layer.mlp.gate_up = native(p + "mlp.gate_up_proj.weight")
            layer.mlp.down = native(p + "mlp.down_proj.weight")  # type: ignore[assignment]
        head = "embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
        self.head = native(head)
        self.linear_choice = KernelChoice()  # recorded; NativeLinear has one path
        return self.linear_choice

    def make_layer(self, config: ModelArchConfig, index: int) -> nn.Module:
        """Decoder layer `index`; an architecture with another block shape overrides this."""
        return DecoderLayer(config)

    def make_norm(self, hidden_size: int, eps: float) -> nn.Module:
        return RMSNorm(hidden_size, eps)

    def layer_weight_names(self, ours: str, hf: str) -> list[tuple[str, list[str]]]:
        """(our name, [HF name]) of a layer's parameters beyond the Llama set (norms, say)."""
        return []

    def prepare_linears(self, choice: KernelChoice | None = None) -> KernelChoice:
        """Binds every projection to its kernels: `choice`, else the fastest on this machine
        (linear_probe, cached per machine). Call after the weights are final; the first forward
        does it when nobody did. Returns the choice. The fast paths are not bound here (this
        module does not know them): llama_fast.prepare calls this, then binds them.

        Where oneDNN serves both shape classes, its packed copies are the only weights read, so
        the plain ones are released (the projections' weight memory is held once, not twice);
        binding again to a kernel that reads them rebuilds them exactly from the packed copies.
        """
        # Fast paths bound to the old kernels are stale: llama_fast.prepare binds them anew.
        self.dense_forward = None
        for layer in self.layers:
            cast(DecoderLayer, layer).fused_step = None
        self.greedy_head = None
        if self.native_parts:
            return self._prepare_native_linears()
        self._restore_plain_weights()
        if choice is None:
            layers = [cast(DecoderLayer, layer) for layer in self.layers]
            weights = [w for layer in layers for w in layer.linear_weights()]
            choice = choose_kernels(weights, self.embed_tokens.weight.device)
        for layer in self.layers:
            cast(DecoderLayer, layer).prepare_linears(choice)
        # The head's products past DECODE_ROWS rows (prompt logprobs) are rare: where the few-row
        # GEMM serves decode it serves them too, so the head is packed once (113 MB for SmolLM2
        # in fp32), not once per kernel.
        head_choice = KernelChoice("skinny", "skinny") if choice.decode == "skinny" else choice
        self.head = Linear(self.lm_head.weight, None, head_choice)
        self.linear_choice = choice
        self._release_plain_weights()
        head_weight = self.lm_head.weight.detach()
        self.greedy_head = GreedyHead(head_weight) if GreedyHead.available(head_weight) else None
        return choice

    def _projections(self) -> list[tuple[nn.Linear, list[Linear | NativeLinear]]]:
        """Each projection module and the Linears over its weight (gate and up share one);
        the lm_head only when it is not the embedding table (which lookups read)."""
        pairs: list[tuple[nn.Linear, list[Linear | NativeLinear]]] = []
        for layer in self.layers:
            layer = cast(DecoderLayer, layer)
            mlp = layer.mlp
            pairs += [(layer.qkv_proj, [layer.qkv]), (layer.o_proj, [layer.o]),
                      (mlp.gate_up_proj, [mlp.gate, mlp.up]), (mlp.down_proj, [mlp.down])]
        if self.lm_head.weight is not self.embed_tokens.weight:
            pairs.append((self.lm_head, [self.head]))
        return pairs

    def _release_plain_weights(self) -> None:
        pairs = self._projections()
        if not all(lin.packed_only for _, linears in pairs for lin in linears):
            return
        with torch.no_grad():
            for module, linears in pairs:
                for lin in linears:
                    assert isinstance(lin, Linear)  # packed_only: NativeLinear never is
                    lin.release_plain()
                weight = module.weight
                weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)
        self._plain_released = True

    def _restore_plain_weights(self) -> None:
        if not self._plain_released:
            return
        with torch.no_grad():
            for module, linears in self._projections():
                module.weight.data = torch.cat([lin.dense() for lin in linears]).contiguous()
        self._plain_released = False

    def _require_linears(self) -> None:
        if self.linear_choice is None:
            self.prepare_linears()

    @classmethod
    def from_state_dict(
        cls,
        config: ModelArchConfig,
        state_dict: Mapping[str, torch.Tensor | QuantizedWeight],
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> LlamaForCausalLM:
        """Build on the meta device (no init, no allocation), then adopt the fused weights.

        Parameters share memory with the given tensors where dtype and device already match (no
        copy); fused ones (qkv, gate_up) too when their parts lie back to back in one buffer, as
        load_gguf lays them out, else they are one torch.cat. Same checks as load_weights.
        """
        with torch.device("meta"):
            model = cls(config)
        model._check_keys(state_dict)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, hf_names in model._fusion_plan():
                parts = [state_dict[n] for n in hf_names]
                module, _, attr = name.rpartition(".")
                if any(isinstance(p, QuantizedWeight) for p in parts):  # native weights
                    dense = [p if isinstance(p, QuantizedWeight) else p.float() for p in parts]
                    model.native_parts[name] = dense
                    rows = sum(p.shape[0] for p in parts)
                    if (rows, parts[0].shape[1]) != tuple(params[name].shape):
                        raise ValueError(
                            f"{hf_names} hold {rows} x {parts[0].shape[1]}, expected "
                            f"{tuple(params[name].shape)}"
                        )
                    placeholder = torch.empty(0, dtype=dtype, device=device)  # never read
                    setattr(model.get_submodule(module), attr, nn.Parameter(placeholder))
                    continue
                weight = _concat_rows([p for p in parts if isinstance(p, torch.Tensor)])
                kept = torch.float32 if keeps_fp32(name) else dtype
                weight = weight.to(device=device, dtype=kept).contiguous()
                _check_shape(hf_names, weight, params[name])
                setattr(model.get_submodule(module), attr, nn.Parameter(weight))
        if config.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        return model.eval()

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionFn,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids [T], positions [T] (any values) -> final-normed hidden states [T, hidden].

        inputs_embeds [T, hidden], when given, replaces the token embeddings (a multimodal model
        has written image features into its placeholder rows); input_ids is then unused.
        """
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and positions must both be 1-D [T]; got {tuple(input_ids.shape)} "
                f"and {tuple(positions.shape)}"
            )
        self._require_linears()
        # [T, hidden] fp32: the residual stream stays fp32 whatever the compute dtype. In bf16,
        # rounding it (and the norms, the MLP's activation and the head) to bf16 cost most of
        # bf16's disagreement with fp32 (docs/benchmarks.md: 97.2% -> 98.9-99.2% teacher-forced);
        # the products and attention, where the time goes, stay bf16.
        hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds.float()
        if self.dense_forward is not None and hidden.shape[0] > 0:
            return self.dense_forward(hidden, positions, attention)
        rope = self.rope_tables(positions, self.compute_dtype)
        for layer_idx, layer in enumerate(self.layers):
            cos, sin = rope[layer_idx]
            hidden = layer(layer_idx, hidden, cos, sin, attention)
        return self.norm(hidden)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the projections and attention compute in (from_state_dict's dtype). The
        embedding table, the lm_head and the norms' weights stay fp32 (keeps_fp32)."""
        return cast(DecoderLayer, self.layers[0]).compute_dtype

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, hidden] fp32, the residual stream's dtype (Gemma scales them); a
        native table dequantizes just the rows asked for."""
        table = self.native_parts.get("embed_tokens.weight")
        if table is not None:
            (weight,) = table
            if isinstance(weight, QuantizedWeight):
                return weight.rows(input_ids).float()
        return self.embed_tokens(input_ids).float()

    def rope_tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (cos, sin), each [T, 1, D/2]; one table shared by all layers here."""
        return [self.rotary.cos_sin(positions, dtype)] * len(self.layers)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> fp32 logits [N, vocab]."""
        self._require_linears()
        return self.head(hidden).float()

    @property
    def has_sampling_head(self) -> bool:
        """sampling_logits reads another head than compute_logits: the bf16 mode with the greedy
        head's bf16 copy (dense weights on a CPU with bf16 products)."""
        return self.greedy_head is not None and self.compute_dtype == torch.bfloat16

    @torch.inference_mode()
    def sampling_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> fp32 logits [N, vocab] for rows sampled at a temperature (no
        logprobs returned). Where has_sampling_head, they come from the head's bf16 product
        (fp32 sums), as a bf16 engine's head computes them, not from the fp32 head the exact
        argmax and logprobs use: the fp32 head cost a served 64-row decode step 10 ms of its
        ~94 (Zen 4). Elsewhere compute_logits."""
        self._require_linears()
        if not self.has_sampling_head:
            return self.compute_logits(hidden)
        assert self.greedy_head is not None
        return self.greedy_head.bf16_logits(hidden)

    @torch.inference_mode()
    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, hidden] -> int64 [N]: argmax of the fp32 logits (-1: a row to compute in
        full), or None when this model has no greedy head (then use compute_logits)."""
        self._require_linears()
        return None if self.greedy_head is None else self.greedy_head(hidden)

    def param_count(self) -> int:
        native = sum(p.shape[0] * p.shape[1] for parts in self.native_parts.values() for p in parts)
        return native + sum(p.numel() for p in self.parameters())  # tied weights counted once

    def weight_bytes(self) -> int:
        """Bytes of weights held: parameters (tied ones once, released ones not at all), the
        kernels' packed copies."""
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        total += sum(
            p.nbytes if isinstance(p, QuantizedWeight) else p.numel() * p.element_size()
            for parts in self.native_parts.values() for p in parts
        )
        if self.linear_choice is not None and not self.native_parts:
            total += sum(lin.packed_bytes for _, linears in self._projections() for lin in linears)
            if self.lm_head.weight is self.embed_tokens.weight:
                total += self.head.packed_bytes  # not among _projections: the table stays
        if self.greedy_head is not None:
            total += self.greedy_head.nbytes
        return total

    @torch.no_grad()
    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy an HF-named state dict in, fusing q/k/v and gate/up; casts to the model's dtype.

        Strict: a missing or unexpected key raises ValueError. `lm_head.weight` is optional (and
        ignored) when embeddings are tied; `rotary_emb.inv_freq` buffers are ignored.
        """
        self._check_keys(state_dict)
        self._restore_plain_weights()
        for dst, names in self._weight_plan():
            src = torch.cat([state_dict[n].to(dst.dtype) for n in names], dim=0)  # [sum(out), ...]
            _check_shape(names, src, dst)
            dst.copy_(src)
        self.linear_choice = None  # packed copies of the old weights are stale: bind anew

    def hf_weight_names(self) -> list[str]:
        """Every HF checkpoint key this config requires."""
        return [name for _, names in self._fusion_plan() for name in names]

    def _check_keys(self, state_dict: Mapping[str, object]) -> None:
        expected = set(self.hf_weight_names())
        given = {k for k in state_dict if not k.endswith("rotary_emb.inv_freq")}
        if self.config.tie_word_embeddings:
            given.discard("lm_head.weight")
        missing, unexpected = sorted(expected - given), sorted(given - expected)
        if missing or unexpected:
            raise ValueError(
                f"state dict does not match {self.config.architecture} config: "
                f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
            )

    def _weight_plan(self) -> list[tuple[torch.Tensor, list[str]]]:
        """(our parameter, HF names concatenated along dim 0 into it)."""
        params = dict(self.named_parameters())
        return [(params[name], hf_names) for name, hf_names in self._fusion_plan()]

    def _fusion_plan(self) -> list[tuple[str, list[str]]]:
        """(our parameter name, HF names concatenated along dim 0 into it): the one fusion map."""
        plan = [
            ("embed_tokens.weight", ["model.embed_tokens.weight"]),
            ("norm.weight", ["model.norm.weight"]),
        ]
        if not self.config.tie_word_embeddings:
            plan.append(("lm_head.weight", ["lm_head.weight"]))
        # nn.ModuleList is typed as holding Modules; self.layers holds DecoderLayers only.
        for i, layer in enumerate(cast("list[DecoderLayer]", self.layers)):
            ours, p = f"layers.{i}.", f"model.layers.{i}."
            qkv = [f"{p}self_attn.{proj}_proj" for proj in ("q", "k", "v")]
            gate_up = [f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"]
            plan.append((f"{ours}qkv_proj.weight", [f"{n}.weight" for n in qkv]))
            if layer.qkv_proj.bias is not None:
                plan.append((f"{ours}qkv_proj.bias", [f"{n}.bias" for n in qkv]))
            plan.append((f"{ours}o_proj.weight", [f"{p}self_attn.o_proj.weight"]))
            if layer.o_proj.bias is not None:
                plan.append((f"{ours}o_proj.bias", [f"{p}self_attn.o_proj.bias"]))
            plan += [
                (f"{ours}mlp.gate_up_proj.weight", gate_up),
                (f"{ours}mlp.down_proj.weight", [f"{p}mlp.down_proj.weight"]),
                (f"{ours}input_layernorm.weight", [f"{p}input_layernorm.weight"]),
                (f"{ours}post_attention_layernorm.weight", [f"{p}post_attention_layernorm.weight"]),
            ]
            plan += self.layer_weight_names(ours, p)
        return plan


def keeps_fp32(name: str) -> bool:
    """Parameters held in fp32 whatever the compute dtype: the embedding table (the residual
    stream starts from it), the lm_head (in bf16 a head with bf16 weights alone cost 1 point of
    teacher-forced agreement with fp32) and the norms' weights (the norms run in fp32)."""
    return name in ("embed_tokens.weight", "lm_head.weight") or name.endswith("norm.weight")


def _concat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(parts, dim=0), but a view without a copy when the parts are contiguous and
    adjacent in one storage, in order (views of one fused buffer)."""
    first = parts[0]
    offset = first.storage_offset()
    for part in parts:
        if (
            not part.is_contiguous()
            or part.dtype != first.dtype
            or part.shape[1:] != first.shape[1:]
            or part.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
            or part.storage_offset() != offset
        ):
            return torch.cat(parts, dim=0)
        offset += part.numel()
    rows = sum(part.shape[0] for part in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


def _check_shape(names: list[str], src: torch.Tensor, dst: torch.Tensor) -> None:
    if src.shape != dst.shape:
        raise ValueError(f"{names} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
