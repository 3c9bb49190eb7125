"""Compiling structured-output constraints (xgrammar) and masking the logits they forbid.

xgrammar was chosen over llguidance by measurement on SmolLM2's 49,152-token vocabulary (AMD
EPYC Zen 5, 2 cores; benchmarks/micro/grammar_backends.py): filling 32 rows' masks from
different states took 0.05 ms median for xgrammar against 0.25 ms (1.8 ms worst) for
llguidance, and it is vLLM's default, so EBNF grammars written for vLLM run unchanged.
Compiling a schema takes 4-5 ms (llguidance: under 1 ms, but it pays later, per token), so
compiled grammars are kept, by the hash of their spec.

Invariant: a Constraint's matcher has accepted exactly the request's output tokens, so the mask
it fills allows exactly the tokens that keep the output inside the grammar (only an end-of-
sequence token once the grammar is complete).
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import Any

import torch

from kvmemo.errors import InputError
from kvmemo.model.loading.fast_tokenizer import FastTokenizer
from kvmemo.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

_PARAM = "structured_outputs"
_CACHE_SIZE = 256  # compiled grammars kept (a schema's is tens of KB)


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:  # pragma: no cover - the Makefile installs it
        raise InputError(
            _PARAM,
            "structured output needs xgrammar: pip install --no-deps xgrammar==0.2.8 "
            "apache-tvm-ffi==0.1.15.post2",
        ) from None
    return xgrammar


class Constraint:
    """One request's grammar state: the mask of its next token, and the tokens it took."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: Any):
        self._matcher = matcher

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its end-of-sequence token taken: nothing left to mask."""
        return bool(self._matcher.is_terminated())

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False (state unchanged) if the grammar forbids it."""
        return bool(self._matcher.accept_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens (a speculative draft's, once checked)."""
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def masks_along(self, draft: Sequence[int], vocab_size: int) -> list[FixedMask]:
        """The next-token mask before each draft token and after the whole draft (len(draft) + 1
        rows: what a plain decode would mask at each step if the draft were its output). The
        draft must be one the grammar accepts (DraftProposer cuts it so); the state is left as
        it was."""
        masks = []
        for i in range(len(draft) + 1):
            bitmask = _xgrammar().allocate_token_bitmask(1, vocab_size)  # all allowed
            if not self._matcher.is_terminated():  # past the end: the row's token is dropped
                self._matcher.fill_next_token_bitmask(bitmask, 0)
            masks.append(FixedMask(bitmask[0]))
            if i < len(draft) and not self._matcher.accept_token(draft[i]):
                raise ValueError(f"draft token {draft[i]} breaks the grammar")
        self.rollback(len(draft))
        return masks


class FixedMask:
    """A next-token mask taken at one point of a grammar (Constraint.masks_along): what the
    sampler masks a draft's row with."""

    __slots__ = ("_words",)
    is_terminated = False  # a draft never runs past the grammar's end (DraftProposer)

    def __init__(self, words: torch.Tensor):
        self._words = words  # [vocab words] int32 bits

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row].copy_(self._words)


class StructuredOutputCompiler:
    """Owns the tokenizer's vocabulary as xgrammar sees it and the compiled grammars by spec."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Collection[int]):
        xgr = _xgrammar()
        start = time.perf_counter()
        if isinstance(tokenizer, FastTokenizer):  # xgrammar reads Hugging Face's own class
            tokenizer = tokenizer.hf
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(eos_token_ids)
        )
        # Its own cache is keyed by the exact text; ours by the compact spec (see `key`).
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self.vocab_size = vocab_size
        self.num_compiled = 0
        self.num_cache_hits = 0
        logger.info("structured output ready in %.2f s", time.perf_counter() - start)

    def constraint(self, params: StructuredOutputsParams) -> Constraint:
        """A fresh Constraint for one request; InputError names a bad schema/regex/grammar."""
        compiled = self._compiled_grammar(params)
        return Constraint(_xgrammar().GrammarMatcher(compiled))

    def _compiled_grammar(self, params: StructuredOutputsParams) -> Any:
        key = params.key
        compiled = self._compiled.get(key)
        if compiled is not None:
            self._compiled.move_to_end(key)
            self.num_cache_hits += 1
            return compiled
        try:
            compiled = self._compile(params)
        except RuntimeError as exc:  # xgrammar's parse and conversion errors
            raise InputError(_PARAM, f"invalid {params.kind}: {_error_text(exc)}") from None
        self.num_compiled += 1
        self._compiled[key] = compiled
        if len(self._compiled) > _CACHE_SIZE:
            self._compiled.popitem(last=False)
        return compiled

    def _compile(self, params: StructuredOutputsParams) -> Any:
        compiler = self._compiler
        # any_whitespace=False: JSON with single spaces after ',' and ':' only. With free
        # whitespace a small model can emit newlines until max_tokens and never close the object.
        if params.json is not None:
            return compiler.compile_json_schema(params.spec, any_whitespace=False)
        if params.json_object:
            # Not strict: an object's properties are free (strict mode would allow only {}).
            return compiler.compile_json_schema(
                '{"type": "object"}', any_whitespace=False, strict_mode=False
            )
        if params.regex is not None:
            return compiler.compile_regex(params.regex)
        if params.choice is not None:
            # JSON string escapes are the EBNF literal's escapes.
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
            return compiler.compile_grammar(f"root ::= {alternatives}")
        assert params.grammar is not None
        return compiler.compile_grammar(params.grammar)


def allowed_token_masks(
    constraints: Sequence[Constraint | FixedMask], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[n, vocab_size] bool: True where constraint i allows the token next."""
    xgr = _xgrammar()
    bitmask = xgr.allocate_token_bitmask(len(constraints), vocab_size)  # [n, words] int32
    for row, constraint in enumerate(constraints):
        constraint.fill_mask(bitmask, row)
    bits = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).view(len(constraints), -1)[:, :vocab_size]
    return allowed.bool().to(device)


def _error_text(exc: Exception) -> str:
    """xgrammar's message without its log prefix ("[12:00:00] /path/file.cc:123: ")."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(exc).strip()).splitlines()[0]
