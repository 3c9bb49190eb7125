"""The bundled SmolLM2 GGUF as an fp32 HF safetensors directory (for engines that need one)."""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvmemo.model.loader import bundled_model_path

    path = Path(bundled_model_path())
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
