"""Tokenizers of GGUF models, converted once and kept on disk by weights fingerprint.

The conversion (Hugging Face's, from the GGUF vocabulary) takes seconds and runs once; every
later start loads the saved directory as a FastTokenizer, with no transformers import.

Invariant: a cached tokenizer is only used when its directory is complete (written to a temp
directory, then renamed); any failure falls back to converting from the GGUF file.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from kvmemo.model.loading.fast_tokenizer import FastTokenizer
from kvmemo.paths import cache_root

logger = logging.getLogger(__name__)


def load_gguf_tokenizer(gguf_path: Path, fingerprint: str) -> Any:
    """The tokenizer of a GGUF file; converting the GGUF vocabulary takes seconds, so the
    converted fast tokenizer is saved under the cache root and loaded from there, as a
    FastTokenizer, next time and this time (the Hugging Face tokenizer where it cannot be saved)."""
    cached = cache_root() / "tokenizers" / fingerprint
    if (cached / "tokenizer.json").is_file():
        try:
            return FastTokenizer(cached)
        except Exception as e:  # a damaged cache entry is a miss, never a failure
            logger.warning("ignoring unreadable cached tokenizer %s: %s", cached, e)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
    )
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".tmp-"))
        tokenizer.save_pretrained(str(staging))
        try:
            os.replace(staging, cached)
        except OSError:  # another process won the race, or an old entry is in the way
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as e:
        logger.warning(
            "could not cache the tokenizer under %s (%s); it will be converted again next time",
            cached.parent,
            e,
        )
        return tokenizer
    try:  # the saved copy, so that this start and the next use the same tokenizer class
        return FastTokenizer(cached, hf=tokenizer)
    except Exception:  # an unreadable entry another process left in the way
        return tokenizer
