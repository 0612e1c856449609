"""A KV-cache manager that shares whole blocks of identical prefixes between sequences.

Every *full* block of a sequence gets a key: a hash chained over the parent
block's key, the block's token ids and the sequence's ``cache_salt`` (anything
else that changes the KV of those tokens: a tenant salt, a model variant such as
a LoRA adapter, whose plugin salts its requests). A new sequence
walks its own chain of keys and reuses every leading block already in the
cache, so its prefill starts after the shared prefix.

Blocks are reference-counted. When the last sequence holding a cached block
lets go, the block keeps its KV and its key and joins an LRU list of
*evictable* blocks; it is reclaimed (least recently released first) only when
the free list is empty and the pool needs room. ``num_free_blocks`` counts
evictable blocks as free, so schedulers see the true headroom.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from mindie_host.api import BlockPool, KVCacheManager, SequenceView

#: key of the (virtual) parent of a sequence's first block
ROOT_KEY = b"\x00" * 16


def block_key(parent: bytes, tokens: list[int] | tuple[int, ...], salt: str | None, extra: bytes = b"") -> bytes:
    """The 16-byte chained key of one full block.

    ``salt`` (the request's ``cache_salt``: a tenant's salt, or what a model-variant
    plugin such as ``multi_lora`` adds) is folded in with a length prefix, so that
    ``None`` and ``""`` never collide. ``extra`` holds the keys of the token spans
    overlapping the block (:func:`span_extra`), e.g. an image's content hash.
    """
    h = hashlib.blake2b(parent, digest_size=16)
    if salt is None:
        h.update(b"\xff")
    else:
        raw = salt.encode()
        h.update(struct.pack("<I", len(raw)))
        h.update(raw)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    if extra:
        h.update(extra)
    return h.digest()


def span_extra(spans: list[tuple[int, int, bytes]] | None, start: int, end: int) -> bytes:
    """The keys of the spans (``SequenceView.span_keys``) that overlap tokens ``[start, end)``, with offsets.

    Tokens whose KV depends on more than their ids (image placeholders) thus key their
    blocks by that content too: the same image shares blocks, a different one never does.
    """
    if not spans:
        return b""
    out = b""
    for lo, hi, key in spans:
        if lo < end and hi > start:
            out += struct.pack("<qqI", lo - start, hi - start, len(key)) + key
    return out


@dataclass
class PrefixCacheStats:
    """Lookup counters behind ``npu_prefix_cache_hit_rate`` (counted when a sequence is admitted)."""

    pool: BlockPool
    queried_blocks: int = 0
    hit_blocks: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def evictions(self) -> int:
        """Cached blocks handed out again for new KV since startup."""
        return self.pool.evictions

    @property
    def hit_rate(self) -> float:
        """Blocks found in the cache / blocks looked up (0.0 before any lookup)."""
        return self.hit_blocks / self.queried_blocks if self.queried_blocks else 0.0


class PrefixCachingKVCacheManager(KVCacheManager):
    """:class:`~mindie_host.api.KVCacheManager` with block sharing by chained hash and LRU eviction.

    Built on the public block pool only: :meth:`match_prefix` walks the sequence's chain of
    keys with ``pool.lookup`` (a pure query), :meth:`acquire_prefix` pins the blocks it finds
    when the engine admits the sequence, and :meth:`on_computed` keys each newly completed
    block with ``pool.register``. Cached blocks nobody holds stay in the pool's LRU list of
    evictable blocks until a new block is needed.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self._chain: dict[int, list[bytes]] = {}  # seq id -> keys of its leading full blocks
        self.counters = PrefixCacheStats(self.pool)

    def num_cached_blocks(self) -> int:
        """Blocks that currently hold a reusable, keyed prefix block (referenced or not)."""
        return self.pool.num_cached()

    def _keys(self, seq: SequenceView, start: int, end: int, parent: bytes) -> list[bytes]:
        """The chained keys of ``seq``'s full blocks ``start`` .. ``end - 1``."""
        bs, keys = self.block_size, []
        spans = getattr(seq, "span_keys", None)
        for i in range(start, end):
            parent = block_key(parent, seq.token_ids[i * bs : (i + 1) * bs], seq.cache_salt,
                               span_extra(spans, i * bs, (i + 1) * bs))
            keys.append(parent)
        return keys

    def _cached_run(self, seq: SequenceView) -> list[int]:
        """The blocks holding ``seq``'s longest cached run of leading blocks (nothing held).

        At least one token is always left to compute (the step that computes it produces
        the logits for the next token), so a prompt entirely cached reuses all but its last block.
        """
        blocks = []
        for key in self._keys(seq, 0, (len(seq.token_ids) - 1) // self.block_size, ROOT_KEY):
            block = self.pool.lookup(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def match_prefix(self, seq: SequenceView) -> int:
        """Tokens of ``seq``'s longest run of cached leading blocks: a pure query."""
        return len(self._cached_run(seq)) * self.block_size

    def acquire_prefix(self, seq: SequenceView) -> int:
        """Pin the cached leading blocks of ``seq`` into its table; count the lookup for the hit rate."""
        if self.block_table(seq):  # already holds blocks: nothing new to share
            return seq.num_computed
        blocks = self._cached_run(seq)
        for block in blocks:
            self.pool.pin(block)
            self.adopt(seq, block)
        self._chain[seq.seq_id] = self._keys(seq, 0, len(blocks), ROOT_KEY)
        bs, c = self.block_size, self.counters
        c.queried_blocks += -(-len(seq.token_ids) // bs)
        c.hit_blocks += len(blocks)
        c.queried_tokens += len(seq.token_ids)
        c.hit_tokens += len(blocks) * bs
        return len(blocks) * bs

    def on_computed(self, seq: SequenceView) -> None:
        """Register every newly completed block of ``seq`` under its chained key."""
        keys = self._chain.setdefault(seq.seq_id, [])
        table = self.block_table(seq)
        full = min(seq.num_computed // self.block_size, len(table))
        if full <= len(keys):
            return
        # when another block already holds a key (two sequences computed the same prefix at once),
        # ours stays private and is freed normally; the chain goes on
        for i, key in enumerate(self._keys(seq, len(keys), full, keys[-1] if keys else ROOT_KEY), len(keys)):
            self.pool.register(table[i], key)
            keys.append(key)

    def free(self, seq: SequenceView) -> None:
        """Drop ``seq``'s references; cached blocks it was last to hold become evictable."""
        self._chain.pop(seq.seq_id, None)
        super().free(seq)

    def reset(self) -> int:
        """Forget every unreferenced cached block; returns how many were dropped."""
        return self.pool.reset()

    def stats(self) -> dict[str, float]:
        """The base block counts plus prefix-cache counters."""
        out = super().stats()
        c = self.counters
        out.update(
            {
                "prefix_cache_hit_rate": c.hit_rate,
                "prefix_cache_hit_tokens": float(c.hit_tokens),
                "prefix_cache_queried_tokens": float(c.queried_tokens),
                "prefix_cache_cached_blocks": float(self.num_cached_blocks()),
                "prefix_cache_evictions": float(c.evictions),
            }
        )
        return out
