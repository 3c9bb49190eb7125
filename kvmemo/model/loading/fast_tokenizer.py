"""FastTokenizer: a saved Hugging Face fast tokenizer driven through `tokenizers` directly.

Why: `AutoTokenizer.from_pretrained` imports transformers and indexes its models (about a
second here) and, for Gemma 3's 262,144-token vocabulary, walks the added tokens in Python (2.5 s
against 0.9 s for the Rust parse alone). The engine uses a handful of the tokenizer's methods, so
it drives the Rust tokenizer itself and starts that much sooner.

Invariant: every method here returns what the same directory's `AutoTokenizer` returns for the
same arguments (ids, texts, tokens, special tokens, rendered chats: the tests compare them). What
this class does not implement is handed to that Hugging Face tokenizer, loaded on first use
(`hf`), so `LLM.tokenizer` keeps the whole API people expect of it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import tokenizers

from kvmemo.model.loading.chat_template import choose_template, render_chat_template

logger = logging.getLogger(__name__)

# The saved tokenizer.json with its BPE merges as "a b" strings (see _write_compact); the
# original stays as Hugging Face saved it, for `hf`.
COMPACT_FILE = "tokenizer.compact.json"

# Hugging Face's named special tokens, in the order its all_special_ids lists them.
SPECIAL_TOKEN_NAMES = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)


class Encoding(dict[str, Any]):
    """What calling a tokenizer returns: a dict of lists, readable as attributes too
    (`tok(text).input_ids`), as Hugging Face's BatchEncoding is."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class FastTokenizer:
    """The tokenizer saved in `directory` (tokenizer.json, tokenizer_config.json and perhaps
    chat_template.jinja), as the engine uses it."""

    def __init__(self, directory: Path, *, hf: Any = None):
        self.directory = Path(directory)
        self.name_or_path = str(self.directory)
        self.backend = _load_backend(self.directory)
        self.backend.no_truncation()  # as Hugging Face's wrapper: whole texts, never padded
        self.backend.no_padding()
        config = json.loads((self.directory / "tokenizer_config.json").read_text())
        template_file = self.directory / "chat_template.jinja"
        template = template_file.read_text() if template_file.is_file() else None
        self.chat_template: str | None = template or config.get("chat_template")
        self.special_tokens_map: dict[str, str] = {
            name: _token_text(config[name]) for name in SPECIAL_TOKEN_NAMES
            if config.get(name) is not None
        }
        self._hf = hf
        self._hf_lock = threading.Lock()
        self._added: list[tuple[list[str], bool]] = []  # add_tokens calls, replayed into hf

    # -- the vocabulary ----------------------------------------------------------------------

    def __len__(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without added tokens (Hugging Face's meaning)."""
        return int(self.backend.get_vocab_size(with_added_tokens=False))

    def get_vocab(self) -> dict[str, int]:
        return dict(self.backend.get_vocab(with_added_tokens=True))

    def convert_tokens_to_ids(self, tokens: str | Iterable[str]) -> Any:
        """A token's id, the unknown token's id for a token not in the vocabulary."""
        if isinstance(tokens, str):
            found = self.backend.token_to_id(tokens)
            return self.unk_token_id if found is None else found
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: int | Iterable[int],
                              skip_special_tokens: bool = False) -> Any:
        ids = _plain_ids(ids)
        if isinstance(ids, int):
            return self.backend.id_to_token(ids)
        special = set(self.all_special_ids) if skip_special_tokens else set()
        return [self.backend.id_to_token(i) for i in ids if i not in special]

    def add_tokens(self, new_tokens: str | Iterable[str], special_tokens: bool = False) -> int:
        """Adds tokens to the vocabulary, as Hugging Face's add_tokens does (a special token is
        matched before normalization); the Hugging Face tokenizer gets them too, now or when it
        loads, so the two never disagree. Returns how many were new."""
        tokens = [new_tokens] if isinstance(new_tokens, str) else list(new_tokens)
        added = [tokenizers.AddedToken(t, special=special_tokens, normalized=not special_tokens)
                 for t in tokens]
        if special_tokens:
            count = self.backend.add_special_tokens(added)
        else:
            count = self.backend.add_tokens(added)
        with self._hf_lock:
            self._added.append((tokens, special_tokens))
            if self._hf is not None:
                self._hf.add_tokens(tokens, special_tokens=special_tokens)
        return int(count)

    # -- special tokens ----------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in SPECIAL_TOKEN_NAMES:
            return self.special_tokens_map.get(name)
        if name.endswith("_id") and name[:-3] in SPECIAL_TOKEN_NAMES:
            text = self.special_tokens_map.get(name[:-3])
            return None if text is None else self.backend.token_to_id(text)
        # Anything else of Hugging Face's API (save_pretrained, padding_side, ...): from its
        # tokenizer, loaded now (once). What changes the vocabulary is implemented above, so
        # the two never disagree.
        return getattr(self.hf, name)

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys(self.special_tokens_map[n] for n in SPECIAL_TOKEN_NAMES
                                  if n in self.special_tokens_map))

    @property
    def all_special_ids(self) -> list[int]:
        ids = (self.backend.token_to_id(t) for t in self.all_special_tokens)
        return [i for i in ids if i is not None]

    # -- text <-> ids ------------------------------------------------------------------------

    def __call__(self, text: str | list[str], add_special_tokens: bool = True) -> Encoding:
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens=add_special_tokens)
            return Encoding(input_ids=ids, attention_mask=[1] * len(ids))
        if not isinstance(text, list) or not all(isinstance(t, str) for t in text):
            raise TypeError("text must be a string or a list of strings")
        encoded = self.backend.encode_batch(text, add_special_tokens=add_special_tokens)
        batch = [list(e.ids) for e in encoded]
        return Encoding(input_ids=batch, attention_mask=[[1] * len(ids) for ids in batch])

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a string, got {type(text).__name__}")
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: int | Iterable[int], skip_special_tokens: bool = False) -> str:
        ids = _plain_ids(ids)
        ids = [ids] if isinstance(ids, int) else list(ids)
        return str(self.backend.decode(ids, skip_special_tokens=skip_special_tokens))

    def batch_decode(self, sequences: Iterable[Iterable[int]],
                     skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        tokenize: bool = True,
        **kwargs: Any,
    ) -> Any:
        """The chat rendered by its template (this tokenizer's unless one is given); its ids
        when tokenize (the template writes the special tokens itself)."""
        text = render_chat_template(
            choose_template(chat_template or self.chat_template, bool(tools)), conversation,
            special_tokens=self.special_tokens_map, tools=tools,
            documents=documents, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **kwargs,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    # -- the rest of Hugging Face's API ------------------------------------------------------

    @property
    def hf(self) -> Any:
        """The same directory's Hugging Face tokenizer (loaded on first use: about a second,
        more for large vocabularies): for xgrammar, and for methods this class leaves out."""
        with self._hf_lock:
            if self._hf is None:
                from transformers import AutoTokenizer

                logger.debug("loading the Hugging Face tokenizer of %s", self.directory)
                hf = AutoTokenizer.from_pretrained(str(self.directory), local_files_only=True)
                for tokens, special in self._added:
                    hf.add_tokens(tokens, special_tokens=special)
                self._hf = hf
            return self._hf

    def __repr__(self) -> str:
        return f"FastTokenizer({self.name_or_path!r}, vocab={len(self)})"


def _plain_ids(ids: Any) -> Any:
    """Token ids as Python ints: tensors and NumPy arrays (and their scalars) are accepted, as
    Hugging Face's tokenizers accept them."""
    return ids.tolist() if hasattr(ids, "tolist") else ids


def _token_text(value: Any) -> str:
    """tokenizer_config.json writes a special token as a string or as an AddedToken dict."""
    return str(value["content"]) if isinstance(value, dict) else str(value)


def _load_backend(directory: Path) -> tokenizers.Tokenizer:
    """The Rust tokenizer, from the compact copy when there is one (writing it otherwise)."""
    compact = directory / COMPACT_FILE
    if compact.is_file():
        try:
            return tokenizers.Tokenizer.from_file(str(compact))
        except Exception as e:  # a damaged copy is rewritten from the original
            logger.warning("ignoring unreadable %s: %s", compact, e)
    source = (directory / "tokenizer.json").read_text(encoding="utf-8")
    backend = tokenizers.Tokenizer.from_str(source)
    _write_compact(directory, source)
    return backend


def _write_compact(directory: Path, source: str) -> None:
    """Writes tokenizer.json again with its BPE merges as "a b" strings, the format before
    [a, b] pairs: the same merges wherever no part holds a space, and parsed in two thirds of
    the time (Gemma 3's 514,906 merges: 0.73 s against 1.11 s). Once per tokenizer; where it
    cannot be written the original is parsed each time."""
    try:
        data = json.loads(source)
        merges = data.get("model", {}).get("merges")
        if isinstance(merges, list) and all(
            isinstance(m, list) and len(m) == 2 and " " not in m[0] and " " not in m[1]
            for m in merges
        ):
            data["model"]["merges"] = [f"{a} {b}" for a, b in merges]
        staging = directory / f".{COMPACT_FILE}.{os.getpid()}"
        staging.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
        os.replace(staging, directory / COMPACT_FILE)
    except (OSError, ValueError) as e:
        logger.debug("no compact tokenizer under %s: %s", directory, e)
