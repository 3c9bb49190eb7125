"""Segmented prompts: a context, reusable chunks, a question (the RAG prompt's shape).

A prompt given as segments is tokenized segment by segment (only the first gets the tokenizer's
BOS), so a chunk has the same token ids wherever it appears, which is what lets its KV be reused
at any position (kv_reuse="blend", see kvmemo/engine/blend_driver.py). Segment 0 is the context
every chunk's KV is computed after (the system prompt); the last is the question, always
computed; each segment between is a chunk.

Chat: `documents` go at the end of the system message, each followed by a blank line; the
conversation is rendered by its chat template with a marker there, and split at it. A
conversation without a system message gets one holding just the documents.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvmemo.errors import InputError

KV_REUSE_MODES = ("prefix", "blend")
DOCUMENT_SEPARATOR = "\n\n"  # after each document, inside the system message
_DOCUMENTS_MARKER = "\ue002"  # a private-use character: no template or user text writes it


@dataclass(frozen=True)
class SegmentPlan:
    """Where each segment starts in the prompt's token ids, and how the request reuses KV."""

    starts: tuple[int, ...]  # token offset of each segment (segment i ends where i + 1 starts)
    kv_reuse: str | None = None  # "prefix" or "blend"; None: the engine's default
    recompute_ratio: float | None = None  # None: the engine's default

    def ranges(self, num_tokens: int) -> list[tuple[int, int]]:
        """[start, end) of every segment."""
        ends = (*self.starts[1:], num_tokens)
        return list(zip(self.starts, ends))


def check_kv_reuse(value: Any, field: str = "kv_reuse") -> str | None:
    if value is not None and value not in KV_REUSE_MODES:
        raise InputError(field, f"{field} must be one of {list(KV_REUSE_MODES)}, got {value!r}")
    return value


def check_recompute_ratio(value: Any, field: str = "recompute_ratio") -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise InputError(field, f"{field} must be a number in [0, 1], got {value!r}")
    return float(value)


def encode_segments(
    segments: Any,
    encode: Callable[[str | list[int], bool], list[int]],
    *,
    kv_reuse: Any = None,
    recompute_ratio: Any = None,
) -> tuple[list[int], SegmentPlan, str | None]:
    """Token ids of the segments joined, their plan, and the text when every segment is text.

    encode(segment, add_special_tokens) tokenizes a string or checks a token-id list.
    Raises InputError naming the segment when one is empty or of the wrong type.
    """
    if not isinstance(segments, (list, tuple)) or len(segments) < 2:
        raise InputError(
            "segments",
            "segments must be a list of at least 2 segments (the context first, the question "
            f"last, chunks between), got {_describe(segments)}",
        )
    token_ids: list[int] = []
    starts: list[int] = []
    for index, segment in enumerate(segments):
        where = f"segments[{index}]"
        if isinstance(segment, str):
            if not segment:
                raise InputError(where, f"{where} is empty; every segment needs text or token ids")
        elif isinstance(segment, (list, tuple)):
            if not segment:
                raise InputError(where, f"{where} is empty; every segment needs text or token ids")
            segment = list(segment)
        else:
            raise InputError(
                where,
                f"{where} must be a string or a list of token ids, got {type(segment).__name__}",
            )
        try:
            ids = encode(segment, index == 0)
        except InputError as e:
            raise InputError(where, f"{where}: {e}") from e
        if not ids:
            raise InputError(where, f"{where} encodes to no tokens")
        starts.append(len(token_ids))
        token_ids.extend(ids)
    text = "".join(segments) if all(isinstance(s, str) for s in segments) else None
    plan = SegmentPlan(
        tuple(starts), check_kv_reuse(kv_reuse), check_recompute_ratio(recompute_ratio)
    )
    return token_ids, plan, text


def check_documents(documents: Any) -> list[str]:
    if not isinstance(documents, (list, tuple)) or not documents:
        raise InputError(
            "documents",
            f"documents must be a non-empty list of strings, got {_describe(documents)}",
        )
    for index, doc in enumerate(documents):
        if not isinstance(doc, str) or not doc.strip():
            raise InputError(
                f"documents[{index}]",
                f"documents[{index}] must be a non-empty string, got {_describe(doc)}",
            )
    return list(documents)


def messages_with_documents_marker(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with the documents' marker at the end of its system message."""
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
        content = out[0]["content"]
        out[0]["content"] = (content + DOCUMENT_SEPARATOR if content else "") + _DOCUMENTS_MARKER
    else:
        out.insert(0, {"role": "system", "content": _DOCUMENTS_MARKER})
    return out


def split_at_documents_marker(rendered: str, documents: Sequence[str]) -> list[str]:
    """[head, document + separator, ..., tail] from a rendering with the marker once."""
    pieces = rendered.split(_DOCUMENTS_MARKER)
    if len(pieces) != 2 or not pieces[0] or not pieces[1]:
        raise InputError(
            "documents",
            "the chat template did not render the system message verbatim, so documents "
            "cannot be placed in it; pass segments to a completion instead",
        )
    return [pieces[0], *(doc + DOCUMENT_SEPARATOR for doc in documents), pieces[1]]


def split_at_separator(prompt: str, separator: str) -> list[str] | None:
    """LMCache's convention: the prompt's text split at a separator string (removed); None
    when the separator does not occur, or leaves an empty segment."""
    if not separator or separator not in prompt:
        return None
    pieces = prompt.split(separator)
    return pieces if all(pieces) else None


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"a {type(value).__name__}"
