"""HF checkpoint directory (config.json + *.safetensors shards) -> (state dict, ModelArchConfig).

Never unpickles: a directory with only pytorch_model*.bin is refused with a clear error.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from kvmemo.model.config import ModelArchConfig


def safetensors_files(directory: str | os.PathLike[str]) -> list[Path]:
    """Sorted *.safetensors files of an HF directory; FileNotFoundError/ValueError if unusable."""
    root = Path(directory)
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {root}; expected an HF model directory")
    files = sorted(root.glob("*.safetensors"))
    if not files:
        if any(root.glob("pytorch_model*.bin")):
            raise ValueError(
                f"{root} has only pytorch_model*.bin (pickle) weights, which kvmemo never loads; "
                "allowed: *.safetensors (convert with transformers' save_pretrained)"
            )
        raise FileNotFoundError(f"no *.safetensors files in {root}")
    return files


def read_hf_config(directory: str | os.PathLike[str]) -> tuple[ModelArchConfig, dict]:
    """ModelArchConfig from config.json, with extra eos ids from generation_config.json if any."""
    raw = read_raw_config(directory)
    return ModelArchConfig.from_hf_config(merge_generation_eos(directory, raw)), raw


def read_raw_config(directory: str | os.PathLike[str]) -> dict:
    return json.loads((Path(directory) / "config.json").read_text())


def merge_generation_eos(directory: str | os.PathLike[str], raw: dict) -> dict:
    """`raw` with generation_config.json's eos ids appended to its eos_token_id, if any."""
    gen_path = Path(directory) / "generation_config.json"
    if gen_path.is_file():
        gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
        if gen_eos is not None:
            merged = _as_list(raw.get("eos_token_id")) + _as_list(gen_eos)
            raw = {**raw, "eos_token_id": list(dict.fromkeys(merged))}
    return raw


def _as_list(value: int | list[int] | None) -> list[int]:
    return [] if value is None else ([value] if isinstance(value, int) else list(value))


def load_safetensors_dir(
    directory: str | os.PathLike[str],
) -> tuple[dict[str, torch.Tensor], ModelArchConfig]:
    """Load every shard into one dict (tensors keep their stored dtype; load_weights casts)."""
    safetensors_files(directory)  # a clear error for a directory without config or weights
    arch_config, _ = read_hf_config(directory)
    return load_state_dict(directory), arch_config


def load_state_dict(directory: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every shard of an HF directory in one dict, keys as stored.

    A key in two shards is an error.
    """
    files = safetensors_files(directory)
    state_dict: dict[str, torch.Tensor] = {}
    for file in files:
        shard = load_file(str(file), device="cpu")
        duplicated = state_dict.keys() & shard.keys()
        if duplicated:
            raise ValueError(f"tensor(s) {sorted(duplicated)[:4]} appear in more than one shard")
        state_dict.update(shard)
    return state_dict
