"""Paged KV-cache block accounting: the default KV-cache manager, built on the public block pool.

The cache holds ``num_blocks`` blocks of ``block_size`` token slots each. A
sequence owns a *block table*: the list of block ids holding its tokens in order.
This module only does the bookkeeping; the backend owns the tensors. Blocks come
from a :class:`~mindie_host.engine.block_pool.BlockPool` (``self.pool``).

Plugins replace or extend the manager through the ``mindie_host_kv_cache_manager``
hook. A manager that shares blocks between sequences overrides :meth:`match_prefix`
(a pure query), :meth:`acquire_prefix` (pins the shared blocks when the engine admits
the sequence) and :meth:`on_computed` (keys newly written blocks), using only the
public pool and :meth:`adopt`.
"""

from __future__ import annotations

from .block_pool import BlockPool, RefCountedBlockPool
from .sequence import SequenceView


class KVCacheManager:
    """Allocates, frees and tracks KV blocks per sequence (no sharing).

    :ivar pool: the :class:`BlockPool` the blocks come from.
    """

    def __init__(self, num_blocks: int, block_size: int, pool: BlockPool | None = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.pool: BlockPool = pool if pool is not None else RefCountedBlockPool(num_blocks)
        self._tables: dict[int, list[int]] = {}

    # -- queries -------------------------------------------------------------
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, or evictable cached ones)."""
        return self.pool.num_free()

    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one live sequence."""
        return self.num_blocks - self.pool.num_free()

    def block_table(self, seq: SequenceView) -> list[int]:
        """The block ids holding ``seq``'s tokens, in order (a copy)."""
        return list(self._tables.get(seq.seq_id, ()))

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
        """How many leading tokens of a waiting ``seq`` the cache could supply now (a multiple of
        ``block_size``). A pure query: nothing is held; the default shares nothing."""
        return 0

    def acquire_prefix(self, seq: SequenceView) -> int:
        """Called when the engine admits ``seq``: hold the cached blocks :meth:`match_prefix` found
        (they may have been evicted since) and put them at the head of its block table.

        :return: how many leading tokens those blocks hold; the engine starts computing there.
        """
        return 0

    def adopt(self, seq: SequenceView, block: int) -> None:
        """Append ``block``, already held for ``seq`` (:meth:`BlockPool.pin`), to ``seq``'s table."""
        self._tables.setdefault(seq.seq_id, []).append(block)

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
            table.append(self.pool.allocate())

    def on_computed(self, seq: SequenceView) -> None:
        """Called after a step has written KV for ``seq`` up to ``seq.num_computed`` tokens."""

    def free_tail(self, seq: SequenceView) -> None:
        """Release ``seq``'s blocks past those its first ``num_computed`` tokens need, last block first: after
        a step wrote KV for tokens that were then taken back (rejected once the step had run), with
        ``num_computed`` counting only the tokens kept. :meth:`on_computed` keys a block only once its tokens
        count as computed, so the blocks released here hold no key."""
        table = self._tables.get(seq.seq_id)
        if table is None:
            return
        keep = -(-seq.num_computed // self.block_size)
        while len(table) > keep:
            self.pool.free(table.pop())

    def free(self, seq: SequenceView) -> None:
        """Release every block of ``seq`` (finished, aborted or preempted), last block first:
        under pressure a shared prefix's tail is evicted before its head."""
        for block in reversed(self._tables.pop(seq.seq_id, [])):
            self.pool.free(block)

    def stats(self) -> dict[str, float]:
        """Numbers for metrics: total, used and free blocks."""
        used = self.num_used_blocks()
        return {
            "kv_blocks_total": float(self.num_blocks),
            "kv_blocks_used": float(used),
            "kv_blocks_free": float(self.num_blocks - used),
            "kv_usage": used / self.num_blocks,
        }
