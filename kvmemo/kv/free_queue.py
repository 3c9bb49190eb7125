"""Intrusive doubly-linked queue of free blocks, between a head and a tail sentinel (the LRU
policy is one; the segmented eviction policies keep several, eviction.py).

Invariant: a node is in the queue iff its links are set. Why intrusive: a cache hit must take a
free block out of the middle of the queue (touch) in O(1) with no allocation, and eviction pops the
head, which is the least recently freed block (blocks freed last-block-first, so tails go first).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar


@dataclass(slots=True, eq=False)
class FreeQueueNode:
    """The links a block carries; None while it is not in the free queue."""

    prev_free: FreeQueueNode | None = field(default=None, repr=False, kw_only=True)
    next_free: FreeQueueNode | None = field(default=None, repr=False, kw_only=True)

    @property
    def is_free(self) -> bool:
        return self.prev_free is not None


NodeT = TypeVar("NodeT", bound=FreeQueueNode)


class FreeBlockQueue(Generic[NodeT]):
    """Owns the free order: popleft() takes the least recently freed, append() adds the newest."""

    def __init__(self, nodes: Iterable[NodeT] = ()) -> None:
        self._head = FreeQueueNode()
        self._tail = FreeQueueNode()
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._num_nodes = 0
        for node in nodes:
            self.append(node)

    def __len__(self) -> int:
        return self._num_nodes

    def popleft(self) -> NodeT:
        """Removes and returns the head (least recently freed). Raises IndexError when empty."""
        node = self._head.next_free
        if node is self._tail:
            raise IndexError("popleft from an empty free queue")
        self.remove(node)  # type: ignore[arg-type]
        return node  # type: ignore[return-value]

    def peek(self) -> NodeT | None:
        """The head (next to evict), left in place; None when empty."""
        node = self._head.next_free
        return None if node is self._tail else node  # type: ignore[return-value]

    def append(self, node: NodeT) -> None:
        """Adds `node` at the tail (most recently freed)."""
        last = self._tail.prev_free
        assert last is not None
        self._link(node, last, self._tail)

    def appendleft(self, node: NodeT) -> None:
        """Adds `node` at the head (the next to evict)."""
        first = self._head.next_free
        assert first is not None
        self._link(node, self._head, first)

    def _link(self, node: NodeT, prev: FreeQueueNode, nxt: FreeQueueNode) -> None:
        assert node.prev_free is None and node.next_free is None, "node is already queued"
        prev.next_free = node
        node.prev_free = prev
        node.next_free = nxt
        nxt.prev_free = node
        self._num_nodes += 1

    def remove(self, node: NodeT) -> None:
        """Unlinks `node` from anywhere in the queue in O(1)."""
        prev, nxt = node.prev_free, node.next_free
        assert prev is not None and nxt is not None, "node is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        node.prev_free = node.next_free = None
        self._num_nodes -= 1

    def __iter__(self) -> Iterator[NodeT]:
        """Head (next to evict) to tail."""
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None
            yield node  # type: ignore[misc]
            node = node.next_free

    def check_links(self) -> None:
        """Asserts that forward and backward links agree and the count is right."""
        count = 0
        prev: FreeQueueNode = self._head
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None and node.prev_free is prev, "broken free-queue link"
            prev, node = node, node.next_free
            count += 1
        assert self._tail.prev_free is prev, "broken free-queue tail link"
        assert count == self._num_nodes, f"free queue holds {count} nodes, not {self._num_nodes}"
