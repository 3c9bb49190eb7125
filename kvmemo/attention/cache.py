"""The paged KV cache: per layer, K and V pages addressed by slot, plus the fp8 transform.

Invariant: k_caches[l] is the logical view [num_blocks, block_size, num_kv_heads, head_dim] of
layer l's physical pages k_pages[l] [num_kv_heads, num_blocks, block_size, head_dim];
slot = block_id * block_size + offset; K is stored already rotated (RoPE applied). An fp8 cache
stores round(((x - offset) @ rotation) / scale) per (layer, kv head), so x ~= stored * scale @
rotation.T + offset (fp8.py); other dtypes store x.
"""

from __future__ import annotations

import logging
import math
import mmap
from dataclasses import dataclass, field

import torch

from kvmemo.attention.workspace import Workspace

logger = logging.getLogger(__name__)

_TORCH_KV_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
}
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448: writes are clamped to +-FP8_MAX * scale


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """'auto' follows the model dtype; other names map to their torch dtype."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in _TORCH_KV_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {['auto', *_TORCH_KV_DTYPES]}, got {kv_cache_dtype!r}"
        )
    return _TORCH_KV_DTYPES[kv_cache_dtype]


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """K and V bytes one token occupies across all layers.

    fp8 scales are per head, not per token, so they are not counted.
    """
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def describe_kv_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> str:
    """'4608 bytes/token (float8_e4m3fn): 0.25x float32, 0.50x bfloat16' for the startup log."""
    size = kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)
    fp32 = kv_bytes_per_token(num_layers, num_kv_heads, head_dim, torch.float32)
    bf16 = kv_bytes_per_token(num_layers, num_kv_heads, head_dim, torch.bfloat16)
    name = str(dtype).removeprefix("torch.")
    return f"{size} bytes/token ({name}): {size / fp32:.2f}x float32, {size / bf16:.2f}x bfloat16"


@dataclass
class PagedKVCache:
    """Owns the K and V pages of every layer and, for fp8, the per-(layer, kv head) scales.

    Pages are head-major so one sequence's keys of one head are [num_blocks, block_size, D]
    rows that gather into a [L, D] matrix with unit row stride, which SDPA reads fastest.
    """

    k_pages: list[torch.Tensor]  # per layer [num_kv_heads, num_blocks, block_size, head_dim]
    v_pages: list[torch.Tensor]
    block_size: int
    k_scales: torch.Tensor | None = None  # fp8 only: [num_layers, num_kv_heads] fp32
    v_scales: torch.Tensor | None = None
    k_offsets: torch.Tensor | None = None  # fp8 only: [num_layers, num_kv_heads, head_dim] fp32
    v_offsets: torch.Tensor | None = None
    rotation: torch.Tensor | None = None  # fp8 only: [head_dim, head_dim] fp32, orthogonal
    # Per layer, its layer group (hybrid layouts: a block id names one group's page of the
    # layers sharing a slot); empty means all 0, a single group.
    layer_groups: list[int] = field(default_factory=list)
    _unrotated: bool = field(default=True, init=False, repr=False)  # rotation is the identity

    def __post_init__(self) -> None:
        if not self.layer_groups:
            self.layer_groups = [0] * len(self.k_pages)

    @classmethod
    def allocate(
        cls,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        slot_of_layer: list[int] | None = None,
        group_of_layer: list[int] | None = None,
    ) -> PagedKVCache:
        """Zeroed pages for every layer. slot_of_layer (a hybrid layout's layer -> slot) makes
        layers of different groups share the page tensor of their slot: a block id then names
        one group's page of those layers, and the pool holds max(slot) + 1 layers per block."""
        shape = (num_kv_heads, num_blocks, block_size, head_dim)
        slots = slot_of_layer if slot_of_layer is not None else list(range(num_layers))
        num_slots = max(slots) + 1
        k_slots = [_zeros(shape, dtype, device) for _ in range(num_slots)]
        v_slots = [_zeros(shape, dtype, device) for _ in range(num_slots)]
        k = [k_slots[slot] for slot in slots]
        v = [v_slots[slot] for slot in slots]
        groups = group_of_layer if group_of_layer is not None else [0] * num_layers
        cache = cls(k_pages=k, v_pages=v, block_size=block_size, layer_groups=list(groups))
        if dtype == FP8_DTYPE:  # the identity transform until calibrated (see fp8.py)
            f32 = torch.float32
            cache.k_scales = torch.ones(num_layers, num_kv_heads, dtype=f32, device=device)
            cache.v_scales = torch.ones(num_layers, num_kv_heads, dtype=f32, device=device)
            offsets_shape = (num_layers, num_kv_heads, head_dim)
            cache.k_offsets = torch.zeros(offsets_shape, dtype=f32, device=device)
            cache.v_offsets = torch.zeros(offsets_shape, dtype=f32, device=device)
            cache.rotation = torch.eye(head_dim, dtype=f32, device=device)
        return cache

    def logical_caches(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s K and V as logical views [num_blocks, block_size, Hkv, D] (no copy).

        The per-layer form of k_caches/v_caches, for hot paths: those build every layer's view.
        """
        return self.k_pages[layer].permute(1, 2, 0, 3), self.v_pages[layer].permute(1, 2, 0, 3)

    @property
    def k_caches(self) -> list[torch.Tensor]:
        """Logical per-layer views [num_blocks, block_size, num_kv_heads, head_dim] (no copy)."""
        return [p.permute(1, 2, 0, 3) for p in self.k_pages]

    @property
    def v_caches(self) -> list[torch.Tensor]:
        return [p.permute(1, 2, 0, 3) for p in self.v_pages]

    @property
    def num_blocks(self) -> int:
        return self.k_pages[0].shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k_pages[0].shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.k_pages[0].dtype

    @property
    def is_fp8(self) -> bool:
        return self.dtype == FP8_DTYPE

    @property
    def distinct_pages(self) -> list[torch.Tensor]:
        """Every page tensor once (hybrid layouts share a slot's tensor between layers)."""
        return list({id(p): p for p in (*self.k_pages, *self.v_pages)}.values())

    @property
    def bytes_per_token(self) -> int:
        """Measured on the allocated pages: bytes of one block's K and V per cached token (all
        layers; a hybrid layout's one group of layers)."""
        total = sum(p.numel() * p.element_size() for p in self.distinct_pages)
        return total // (self.num_blocks * self.block_size)

    def set_scales(
        self,
        k_scales: torch.Tensor,
        v_scales: torch.Tensor,
        *,
        k_offsets: torch.Tensor | None = None,
        v_offsets: torch.Tensor | None = None,
        rotation: torch.Tensor | None = None,
    ) -> None:
        """Install the fp8 transform (fp8.KVScales); only before any KV is written.

        scales [num_layers, num_kv_heads] > 0; offsets [num_layers, num_kv_heads, head_dim]
        (None: zero); rotation [head_dim, head_dim] orthogonal (None: identity).
        """
        if not self.is_fp8 or self.k_scales is None or self.v_scales is None:
            raise ValueError(f"scales apply to an fp8 KV cache only, this one is {self.dtype}")
        assert (
            self.k_offsets is not None and self.v_offsets is not None and self.rotation is not None
        )
        for name, new in (("k_scales", k_scales), ("v_scales", v_scales)):
            if new.shape != self.k_scales.shape or not bool((new > 0).all()):
                raise ValueError(
                    f"{name} must be positive with shape {tuple(self.k_scales.shape)}, "
                    f"got {tuple(new.shape)}"
                )
        for name, offsets in (("k_offsets", k_offsets), ("v_offsets", v_offsets)):
            if offsets is not None and (
                offsets.shape != self.k_offsets.shape or not bool(offsets.isfinite().all())
            ):
                raise ValueError(
                    f"{name} must be finite with shape {tuple(self.k_offsets.shape)}, "
                    f"got {tuple(offsets.shape)}"
                )
        eye = torch.eye(self.rotation.shape[0])
        if rotation is not None and (
            rotation.shape != eye.shape
            or not torch.allclose(rotation.float().cpu() @ rotation.float().cpu().T, eye, atol=1e-5)
        ):
            raise ValueError(f"rotation must be an orthogonal {tuple(eye.shape)} matrix")
        self.k_scales.copy_(k_scales)
        self.v_scales.copy_(v_scales)
        if k_offsets is None:
            k_offsets = torch.zeros_like(self.k_offsets)
        if v_offsets is None:
            v_offsets = torch.zeros_like(self.v_offsets)
        self.k_offsets.copy_(k_offsets)
        self.v_offsets.copy_(v_offsets)
        self.rotation.copy_(rotation if rotation is not None else eye)
        self._unrotated = bool(torch.equal(self.rotation.cpu(), eye))  # skip two matmuls per layer

    def copy_block_prefixes(self, copies: list[tuple[int, int, int]]) -> None:
        """Partial reuse: copy the first num_tokens slots of src into dst, in the given order.

        Order matters: a later copy may overwrite a block an earlier one read from. Bytes are
        copied as stored, so fp8 pages keep their (per-head, not per-block) scales valid.
        """
        all_pages = self.distinct_pages
        sources = {src for src, _, _ in copies}
        destinations = [dst for _, dst, _ in copies]
        if len(copies) > 1 and not sources & set(destinations) \
                and len(set(destinations)) == len(destinations):
            # Independent copies (a step's new sequences each copying a shared partial block):
            # one gather and one scatter per page tensor instead of one copy per block and layer.
            bs = self.block_size
            device = all_pages[0].device  # one pool: every page tensor lives there
            src_slots = torch.cat([torch.arange(s * bs, s * bs + n) for s, _, n in copies])
            dst_slots = torch.cat([torch.arange(d * bs, d * bs + n) for _, d, n in copies])
            src_slots, dst_slots = src_slots.to(device), dst_slots.to(device)
            for pages in all_pages:
                flat = pages.view(pages.shape[0], -1, pages.shape[-1])  # [Hkv, slots, D]
                if flat.dtype == FP8_DTYPE:  # index ops lack fp8 kernels; the bytes are the same
                    flat = flat.view(torch.uint8)
                flat.index_copy_(1, dst_slots, flat.index_select(1, src_slots))
            return
        for src, dst, num_tokens in copies:
            for pages in all_pages:
                pages[:, dst, :num_tokens].copy_(pages[:, src, :num_tokens])

    def write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Scatter this step's K and V ([T, Hkv, D]) of one layer into their slots.

        An fp8 cache quantises them first.
        """
        k_fp8 = v_fp8 = None
        if self.is_fp8:
            k_fp8, v_fp8 = self.fp8_transform(layer, "k"), self.fp8_transform(layer, "v")
        _write_pages(self.k_pages[layer], k, slot_mapping, k_fp8)
        _write_pages(self.v_pages[layer], v, slot_mapping, v_fp8)

    def fp8_transform(self, layer: int, which: str) -> Fp8Transform:
        """Layer `layer`'s K ('k') or V ('v') transform of an fp8 cache."""
        if which == "k":
            scales, offsets = self.k_scales, self.k_offsets
        else:
            scales, offsets = self.v_scales, self.v_offsets
        if scales is None or offsets is None or self.rotation is None:
            raise ValueError(
                f"an fp8 transform exists for an fp8 KV cache only, this one is {self.dtype}"
            )
        rotation = None if self._unrotated else self.rotation
        return Fp8Transform(scales[layer], offsets[layer], rotation)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor. On CPU its memory is an anonymous mapping, whose pages the OS supplies
    zeroed on first touch: the pool costs memory as blocks fill, not at start (torch.zeros
    writes every page: a 2 GiB pool was 2 GiB of RSS before the first request)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if num_bytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # frombuffer keeps the mapping alive for as long as the tensor (or a view of it) lives.
    raw = torch.frombuffer(mmap.mmap(-1, num_bytes), dtype=torch.uint8)
    return raw.view(dtype).view(shape)


def gather_pages(
    pages: torch.Tensor,
    block_ids: torch.Tensor,
    dtype: torch.dtype,
    name: str,
    workspace: Workspace,
) -> torch.Tensor:
    """pages [Hkv, num_blocks, bs, D] -> [Hkv, n * bs, D] of the given blocks, in `dtype`.

    Gathers into a reused buffer; a cache stored in another dtype (bf16, fp8) is converted into a
    second reused buffer, the raw fp8 values untransformed (fp8_fold.fold_fp8_query and
    unfold_fp8_output apply the scale, offset and rotation to q and the output instead).
    """
    num_kv_heads, _, block_size, head_dim = pages.shape
    shape = (num_kv_heads, block_ids.numel(), block_size, head_dim)
    raw = workspace.get(name, shape, pages.dtype, pages.device)
    torch.index_select(pages, 1, block_ids, out=raw)
    if pages.dtype != dtype:
        converted = workspace.get(name + "_converted", shape, dtype, pages.device)
        if pages.dtype == FP8_DTYPE and pages.device.type == "cpu":
            bits = workspace.get(name + "_bits", shape, torch.int16, pages.device)
            raw = fp8_to_float(raw, converted, bits)
        else:
            raw = converted.copy_(raw)
    return raw.view(num_kv_heads, -1, head_dim)


def fp8_to_float(src: torch.Tensor, out: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Exact e4m3 -> float conversion into `out` through fp16 bit patterns (`bits`: int16 scratch).

    torch's CPU cast converts one element at a time (measured 54 ms for 6.3M values); this takes
    four vectorised passes (11.6 ms). Shifting e4m3's 7 exponent+mantissa bits left by 7 lands
    them in fp16's field positions, so the fp16 reads x * 2^-8 (subnormals included, since both
    formats' subnormals share the zero exponent field); the sign-extended byte put a stray bit 14
    next to the sign, which the mask clears; the final * 256 is exact in fp16.
    """
    bits.copy_(src.view(torch.int8))  # sign-extend: bit 7 -> bits 8..15
    bits.bitwise_left_shift_(7).bitwise_and_(-16385)  # -16385 == 0xBFFF: clear bit 14
    return torch.mul(bits.view(torch.float16), 256.0, out=out)


@dataclass(frozen=True, slots=True)
class Fp8Transform:
    """One layer's K or V fp8 transform: stored = fp8(((x - offset) @ rotation) / scale)."""

    scale: torch.Tensor  # [Hkv] fp32, powers of two
    offset: torch.Tensor  # [Hkv, D] fp32
    rotation: torch.Tensor | None  # [D, D] fp32, orthogonal; None: the identity


def quantize_fp8(x: torch.Tensor, transform: Fp8Transform) -> torch.Tensor:
    """x [T, Hkv, D] -> fp8 values of ((x - offset) @ rotation) / scale.

    Clamped to the fp8 range.
    """
    y = x.float() - transform.offset  # [T, Hkv, D]
    if transform.rotation is not None:
        y = y @ transform.rotation
    return (y / transform.scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(
    stored: torch.Tensor, transform: Fp8Transform, dtype: torch.dtype
) -> torch.Tensor:
    """stored [..., Hkv, D] fp8 -> real values stored * scale @ rotation.T + offset, in `dtype`."""
    y = stored.float() * transform.scale[:, None]
    if transform.rotation is not None:
        y = y @ transform.rotation.T
    return (y + transform.offset).to(dtype)


def _write_pages(
    pages: torch.Tensor, x: torch.Tensor, slot_mapping: torch.Tensor, transform: Fp8Transform | None
) -> None:
    num_kv_heads, num_blocks, block_size, head_dim = pages.shape
    values = quantize_fp8(x, transform) if transform is not None else x.to(pages.dtype)
    flat = pages.view(num_kv_heads, num_blocks * block_size, head_dim)  # [Hkv, slots, D]
    if pages.dtype == FP8_DTYPE:  # index_copy_ has no fp8 CPU kernel; the bytes are the same
        flat, values = flat.view(torch.uint8), values.view(torch.uint8)
    flat.index_copy_(1, slot_mapping, values.transpose(0, 1))  # source [Hkv, T, D]


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter unscaled K and V ([T, Hkv, D]) into logical caches [num_blocks, bs, Hkv, D].

    For tests and tools that fill pages directly; the engine writes through PagedKVCache.write.
    """
    for cache, x in ((k_cache, k), (v_cache, v)):
        flat = cache.view(-1, *cache.shape[2:])  # [slots, Hkv, D]; a view (raises, never copies)
        values = x.to(cache.dtype)
        if cache.dtype == FP8_DTYPE:
            flat, values = flat.view(torch.uint8), values.view(torch.uint8)
        flat.index_copy_(0, slot_mapping, values)
