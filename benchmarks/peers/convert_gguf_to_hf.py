"""The bundled SmolLM2 GGUF as an fp32 HF safetensors directory (for engines that need one).

    python -m benchmarks.peers.convert_gguf_to_hf --out benchmarks/peers/hf-smollm2-fp32

Runs in kvmemo's own virtualenv (it needs kvmemo and transformers); setup_vllm.sh calls it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvmemo.model.loading.loader import bundled_model_path

    path = Path(bundled_model_path())
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    # A GGUF-loaded model refuses save_pretrained ("quantized with gguf"): its weights are plain
    # fp32 already, so move them into a model built from the same config and save that.
    config = model.config
    config.quantization_config = None
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    config_path = Path(args.out) / "config.json"  # drop the null key: peers read it as "quantized"
    saved = json.loads(config_path.read_text())
    saved.pop("quantization_config", None)
    config_path.write_text(json.dumps(saved, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
