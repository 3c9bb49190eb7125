"""HF transformers, one request at a time (model.generate has no continuous batching), fp32."""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks.runners.engines.base import EngineRunner


class _FirstTokenClock:
    """A generate() streamer that notes when the first new token arrives (the first put() is
    the prompt)."""

    def __init__(self) -> None:
        self.num_puts = 0
        self.first_token_at: float | None = None

    def put(self, value) -> None:
        self.num_puts += 1
        if self.num_puts == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


class HFRunner(EngineRunner):
    def __init__(self, model, options: dict) -> None:
        import transformers

        super().__init__("hf-transformers", transformers.__version__, options)
        self.model = model

    def generate_one(self, prompt_token_ids: list[int], max_tokens: int):
        import torch

        clock = _FirstTokenClock()
        input_ids = torch.tensor([prompt_token_ids])
        out = self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                  max_new_tokens=max_tokens, min_new_tokens=max_tokens, streamer=clock)
        return out[0, len(prompt_token_ids):].tolist(), clock.first_token_at, None


def make_runner(
    *, model: str | None, prefix_caching: bool, threads: int, kv_store: str | None,
    dtype: str = "float32",
) -> HFRunner:
    import torch
    from transformers import AutoModelForCausalLM

    if model is None:
        raise SystemExit("--model PATH.gguf is required for the hf engine")
    if dtype != "float32":
        raise SystemExit("the hf reference runs float32 only")
    torch.set_num_threads(threads)
    path = Path(model)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return HFRunner(hf.eval(), {"model": path.name, "dtype": "float32", "threads": threads})
