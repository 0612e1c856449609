"""The KV block pool: the public protocol every KV-cache manager allocates from, and the builtin pool.

A *block* holds ``block_size`` token slots of KV in the backend's cache tensors; the
pool only does the bookkeeping. Every block has a reference count: the number of
sequences whose block table holds it. A block may also carry a *content key*
(:meth:`BlockPool.register`): bytes that identify the KV it holds, such as a hash
chained over the token ids. A keyed block whose count drops to zero keeps its KV and
its key and becomes *evictable*: it counts as free, is handed out again only when no
plain free block is left (least recently released first), and until then anyone can
find it by key (:meth:`BlockPool.lookup`, a pure query) and take it back
(:meth:`BlockPool.pin`, an explicit call).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Protocol, runtime_checkable


@runtime_checkable
class BlockPool(Protocol):
    """Allocate, free, reference-count, look up by key (pure) and pin (explicit) KV blocks."""

    num_blocks: int
    #: evictable blocks handed out again (their key forgotten) since startup
    evictions: int

    def allocate(self) -> int:
        """A block for new KV, with reference count 1: a free block, else the least recently
        released evictable one (its key is forgotten). Raises :class:`MemoryError` when none is left."""
        ...

    def free(self, block: int) -> None:
        """Drop one reference; at zero the block becomes free, or evictable if it has a key."""
        ...

    def pin(self, block: int) -> None:
        """Take one more reference to ``block`` (one found by :meth:`lookup`, or one already held);
        an evictable block stops being evictable."""
        ...

    def ref_count(self, block: int) -> int:
        """How many references ``block`` has (0: free or evictable)."""
        ...

    def lookup(self, key: bytes) -> int | None:
        """The block holding content ``key``, or ``None``. A pure query: no reference, no LRU change."""
        ...

    def register(self, block: int, key: bytes) -> bool:
        """Record that ``block`` (held, fully written) holds content ``key``. False, and nothing
        recorded, when another block already holds that key or ``block`` already has a key."""
        ...

    def num_free(self) -> int:
        """Blocks :meth:`allocate` can hand out now: free plus evictable."""
        ...

    def num_cached(self) -> int:
        """Blocks that carry a key, referenced or not."""
        ...

    def reset(self) -> int:
        """Forget the key of every evictable block (they become plain free blocks); returns how many."""
        ...


class RefCountedBlockPool:
    """The builtin :class:`BlockPool`: reference counts, content keys and an LRU list of evictable blocks."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self._key_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently released first
        #: evictable blocks handed out again (their key forgotten) since startup
        self.evictions = 0

    def allocate(self) -> int:
        if self._free:
            block = self._free.popleft()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._key_of.pop(block)]
            self.evictions += 1
        else:
            raise MemoryError(f"all {self.num_blocks} KV blocks are in use")
        self._refs[block] = 1
        return block

    def free(self, block: int) -> None:
        refs = self._refs[block] - 1
        if refs < 0:
            raise ValueError(f"KV block {block} freed more often than it was held")
        self._refs[block] = refs
        if refs:
            return
        if block in self._key_of:
            self._evictable[block] = None
        else:
            self._free.append(block)

    def pin(self, block: int) -> None:
        if self._refs[block] == 0:
            if block not in self._evictable:
                raise ValueError(f"KV block {block} is free: allocate blocks, pin only held or cached ones")
            del self._evictable[block]
        self._refs[block] += 1

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def lookup(self, key: bytes) -> int | None:
        return self._block_of.get(key)

    def register(self, block: int, key: bytes) -> bool:
        if key in self._block_of or block in self._key_of:
            return False
        self._block_of[key] = block
        self._key_of[block] = key
        return True

    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    def num_cached(self) -> int:
        return len(self._key_of)

    def reset(self) -> int:
        """Forget every evictable block's content; returns how many were dropped."""
        dropped = 0
        while self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._key_of.pop(block)]
            self._free.append(block)
            dropped += 1
        return dropped
