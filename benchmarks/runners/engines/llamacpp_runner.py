"""llama-cpp-python on the same GGUF, one request at a time, with its prompt-prefix reuse on."""

from __future__ import annotations

import time

from benchmarks.runners.engines.base import EngineRunner


class LlamaCppRunner(EngineRunner):
    def __init__(self, llm, options: dict) -> None:
        import llama_cpp

        super().__init__("llama.cpp", f"llama-cpp-python {llama_cpp.__version__}", options)
        self.llm = llm
        self._eos = llm.token_eos()

    def _no_eos(self, input_ids, scores):
        scores[self._eos] = -float("inf")  # every engine generates exactly max_tokens
        return scores

    def generate_one(self, prompt_token_ids: list[int], max_tokens: int):
        import llama_cpp

        first_token_at = None
        token_ids: list[int] = []
        cache = self.llm.cache
        if cache is not None:
            # llama.cpp's prompt reuse, as create_completion does it: restore the saved state with
            # the longest common prefix; generate() then skips the tokens that state already holds.
            try:
                self.llm.load_state(cache[prompt_token_ids])
            except KeyError:
                pass
        for token in self.llm.generate(prompt_token_ids, temp=0.0, top_k=1,
                                       logits_processor=llama_cpp.LogitsProcessorList([self._no_eos])):
            if first_token_at is None:
                first_token_at = time.perf_counter()
            token_ids.append(token)
            if len(token_ids) == max_tokens:
                break
        if cache is not None:
            cache[self.llm._input_ids.tolist()] = self.llm.save_state()
        return token_ids, first_token_at, None


def make_runner(
    *, model: str | None, prefix_caching: bool, threads: int, kv_store: str | None,
    dtype: str = "float32",
) -> LlamaCppRunner:
    import llama_cpp

    if model is None:
        raise SystemExit("--model PATH.gguf is required for the llama.cpp engine")
    llm = llama_cpp.Llama(model_path=model, n_ctx=8192, n_threads=threads, n_batch=512, verbose=False)
    if prefix_caching:
        llm.set_cache(llama_cpp.LlamaRAMCache(capacity_bytes=2 << 30))
    return LlamaCppRunner(llm, {"model": model, "n_ctx": 8192, "threads": threads,
                                "prompt_cache": "LlamaRAMCache 2 GiB" if prefix_caching else None})
