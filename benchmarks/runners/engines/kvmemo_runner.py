"""kvmemo through its Engine API: continuous batching, prefix caching on unless asked off."""

from __future__ import annotations

from pathlib import Path

from benchmarks.runners.engines.base import EngineRunner


class KvmemoRunner(EngineRunner):
    def __init__(self, engine, options: dict) -> None:
        import kvmemo

        super().__init__("kvmemo", getattr(kvmemo, "__version__", "dev"), options)
        self.engine = engine
        from kvmemo import SamplingParams

        self._params = SamplingParams

    def submit(self, index: int, prompt_token_ids: list[int], max_tokens: int) -> None:
        params = self._params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        prompt = self.engine.processor.process(list(prompt_token_ids))
        self.engine.add_request(str(index), prompt, params)

    def step(self):
        return [(int(out.request_id), list(out.outputs[0].token_ids), out.finished,
                 out.metrics.num_cached_tokens) for out in self.engine.step()]


def make_runner(
    *, model: str | None, prefix_caching: bool, threads: int, kv_store: str | None,
    dtype: str = "float32",
) -> KvmemoRunner:
    from kvmemo.config import EngineConfig
    from kvmemo.engine import Engine
    from kvmemo.model.loading.loader import resolve_weights_mode

    options = {"model": model, "enable_prefix_caching": prefix_caching, "num_threads": threads,
               "kv_store": kv_store, "dtype": dtype}
    engine = Engine(EngineConfig.from_kwargs(**options))
    # Which weights ran: "auto" resolves by $KVMEMO_WEIGHTS (benchmarks/__init__.py: dense
    # unless the run asks for native, the default mode).
    weights = resolve_weights_mode("auto", Path(engine.loaded.path), str(engine.device))
    recorded = {**options, "weights": weights}
    return KvmemoRunner(engine, recorded)
