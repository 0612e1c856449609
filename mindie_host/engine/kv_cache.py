"""Paged KV-cache block accounting: the default KV-cache manager.

The cache holds ``num_blocks`` blocks of ``block_size`` token slots each. A
sequence owns a *block table*: the list of block ids holding its tokens in order.
This module only does the bookkeeping; the backend owns the tensors.

Plugins replace or extend this through the ``mindie_host_kv_cache_manager`` hook
(``prefix_cache`` subclasses :class:`KVCacheManager` to share blocks by hash).
"""

from __future__ import annotations

from collections import deque

from .sequence import SequenceView


class KVCacheManager:
    """Allocates, frees and tracks KV blocks per sequence (no sharing).

    Subclasses override :meth:`match_prefix`, :meth:`on_computed` and the block
    pool methods to share blocks between sequences.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[int, list[int]] = {}

    # -- queries -------------------------------------------------------------
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, or evictable by a subclass)."""
        return len(self._free)

    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one live sequence."""
        return self.num_blocks - len(self._free)

    def block_table(self, seq: SequenceView) -> list[int]:
        """The block ids holding ``seq``'s tokens, in order."""
        return self._tables.get(seq.seq_id, [])

    def blocks_needed(self, seq: SequenceView, num_new_tokens: int) -> int:
        """How many new blocks ``seq`` needs to hold ``num_new_tokens`` more computed tokens."""
        have = len(self._tables.get(seq.seq_id, ()))
        need = -(-(seq.num_computed + num_new_tokens) // self.block_size)
        return max(0, need - have)

    def can_allocate(self, seq: SequenceView, num_new_tokens: int) -> bool:
        """Whether :meth:`allocate` would succeed now."""
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks()

    # -- lifecycle -----------------------------------------------------------
    def match_prefix(self, seq: SequenceView) -> int:
        """Called when a waiting sequence is admitted. Returns how many leading tokens
        already have KV in the cache (a multiple of ``block_size``), after making the
        sequence's block table reference those blocks. The default shares nothing."""
        self._tables.setdefault(seq.seq_id, [])
        return 0

    def allocate(self, seq: SequenceView, num_new_tokens: int) -> None:
        """Make room for ``num_new_tokens`` more tokens after ``seq.num_computed``.

        Raises :class:`MemoryError` if there are not enough blocks; callers check
        :meth:`can_allocate` first.
        """
        need = self.blocks_needed(seq, num_new_tokens)
        if need > self.num_free_blocks():
            raise MemoryError(f"need {need} KV blocks, {self.num_free_blocks()} free")
        table = self._tables.setdefault(seq.seq_id, [])
        for _ in range(need):
            table.append(self._take_block())

    def on_computed(self, seq: SequenceView) -> None:
        """Called after a step has written KV for ``seq`` up to ``seq.num_computed`` tokens."""

    def free(self, seq: SequenceView) -> None:
        """Release every block of ``seq`` (finished, aborted or preempted)."""
        for block in reversed(self._tables.pop(seq.seq_id, [])):
            self._release_block(block)

    # -- block pool (overridable) --------------------------------------------
    def _take_block(self) -> int:
        return self._free.popleft()

    def _release_block(self, block: int) -> None:
        self._free.append(block)

    def stats(self) -> dict[str, float]:
        """Numbers for metrics: total, used and free blocks."""
        used = self.num_used_blocks()
        return {
            "kv_blocks_total": float(self.num_blocks),
            "kv_blocks_used": float(used),
            "kv_blocks_free": float(self.num_blocks - used),
            "kv_usage": used / self.num_blocks,
        }
