"""Multimodal items in a prompt: where each one's placeholder tokens sit and what it is (its content
hash), the part of the hashing contract that blocks overlapping an item carry in their keys.

Invariant: a prompt's items are sorted by offset and never overlap (hashing.py checks it), so
overlapping_items is a bisect.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter


@dataclass(frozen=True, slots=True)
class MultiModalItem:
    """One image (or other item) in a prompt: where its placeholder tokens sit and what it is."""

    offset: int  # index of the item's first placeholder token in the prompt
    length: int  # number of placeholder tokens
    content_hash: bytes  # sha256 over the processed content and processor settings

    @property
    def end(self) -> int:
        return self.offset + self.length


_ITEM_END = attrgetter("end")  # MultiModalItem.end, as a bisect key


def overlapping_items(items: Sequence[MultiModalItem], start: int, end: int) -> range:
    """Indices of the items (sorted by offset, non-overlapping) whose range meets [start, end).

    A bisect on the item ends: O(log items), whatever the prompt length.
    """
    first = bisect_right(items, start, key=_ITEM_END)  # first item ending after `start`
    last = first
    while last < len(items) and items[last].offset < end:
        last += 1
    return range(first, last)
