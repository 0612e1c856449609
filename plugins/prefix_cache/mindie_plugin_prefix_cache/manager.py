"""A KV-cache manager that shares whole blocks of identical prefixes between sequences.

Every *full* block of a sequence gets a key: a hash chained over the parent
block's key, the block's token ids, the sequence's LoRA adapter and its
``cache_salt`` (anything that changes the KV of those tokens). A new sequence
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
from collections import OrderedDict
from dataclasses import dataclass

from mindie_host.api import KVCacheManager, SequenceView

#: key of the (virtual) parent of a sequence's first block
ROOT_KEY = b"\x00" * 16


def block_key(
    parent: bytes, tokens: list[int] | tuple[int, ...], adapter: str | None, salt: str | None, extra: bytes = b""
) -> bytes:
    """The 16-byte chained key of one full block.

    ``adapter`` and ``salt`` are folded in with a length prefix so that
    ``(None, "x")`` and ``("x", None)`` never collide. ``extra`` holds the keys of the
    token spans overlapping the block (:func:`span_extra`), e.g. an image's content hash.
    """
    h = hashlib.blake2b(parent, digest_size=16)
    for part in (adapter, salt):
        if part is None:
            h.update(b"\xff")
        else:
            raw = part.encode()
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
    """Lookup counters behind ``npu_prefix_cache_hit_rate``."""

    queried_blocks: int = 0
    hit_blocks: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        """Blocks found in the cache / blocks looked up (0.0 before any lookup)."""
        return self.hit_blocks / self.queried_blocks if self.queried_blocks else 0.0


class PrefixCachingKVCacheManager(KVCacheManager):
    """:class:`~mindie_host.api.KVCacheManager` with block sharing by chained hash and LRU eviction."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self._refs: list[int] = [0] * num_blocks
        self._key_of: dict[int, bytes] = {}  # block id -> key, for cached blocks
        self._block_of: dict[bytes, int] = {}  # key -> block id
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 cached blocks, LRU first
        self._chain: dict[int, list[bytes]] = {}  # seq id -> keys of its leading full, registered blocks
        self.counters = PrefixCacheStats()

    # -- queries -------------------------------------------------------------
    def num_free_blocks(self) -> int:
        """Free blocks plus cached blocks nobody references (evicted on demand)."""
        return len(self._free) + len(self._evictable)

    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks()

    def num_cached_blocks(self) -> int:
        """Blocks that currently hold a reusable, keyed prefix block (referenced or not)."""
        return len(self._key_of)

    # -- lifecycle -----------------------------------------------------------
    def match_prefix(self, seq: SequenceView) -> int:
        """Reference the longest run of cached leading blocks of ``seq``; return its token count.

        At least one token is always left to compute (the step that computes it
        produces the logits for the next token), so a prompt that is entirely
        cached reuses all but its last block.
        """
        bs = self.block_size
        tokens = seq.token_ids
        table = self._tables.setdefault(seq.seq_id, [])
        if table:  # already matched/allocated: nothing new to share
            return seq.num_computed
        usable = (len(tokens) - 1) // bs
        keys: list[bytes] = []
        parent = ROOT_KEY
        for i in range(usable):
            key = block_key(parent, tokens[i * bs : (i + 1) * bs], seq.adapter, seq.cache_salt,
                            span_extra(getattr(seq, "span_keys", None), i * bs, (i + 1) * bs))
            block = self._block_of.get(key)
            if block is None:
                break
            self._ref(block)
            table.append(block)
            keys.append(key)
            parent = key
        self._chain[seq.seq_id] = keys
        c = self.counters
        c.queried_blocks += -(-len(tokens) // bs)
        c.hit_blocks += len(keys)
        c.queried_tokens += len(tokens)
        c.hit_tokens += len(keys) * bs
        return len(keys) * bs

    def on_computed(self, seq: SequenceView) -> None:
        """Register every newly completed block of ``seq`` under its chained key."""
        bs = self.block_size
        keys = self._chain.setdefault(seq.seq_id, [])
        table = self._tables.get(seq.seq_id, [])
        full = min(seq.num_computed // bs, len(table))
        parent = keys[-1] if keys else ROOT_KEY
        for i in range(len(keys), full):
            key = block_key(parent, seq.token_ids[i * bs : (i + 1) * bs], seq.adapter, seq.cache_salt,
                            span_extra(getattr(seq, "span_keys", None), i * bs, (i + 1) * bs))
            block = table[i]
            owner = self._block_of.get(key)
            if owner is None and block not in self._key_of:
                self._block_of[key] = block
                self._key_of[block] = key
            # when another block already holds this key (two sequences computed the same
            # prefix at once), ours stays private and is freed normally; the chain goes on
            keys.append(key)
            parent = key

    def free(self, seq: SequenceView) -> None:
        """Drop ``seq``'s references; cached blocks it was last to hold become evictable.

        Blocks are released tail first, so under pressure a prefix's last blocks
        are evicted before its first ones (a shorter prefix stays reusable).
        """
        self._chain.pop(seq.seq_id, None)
        super().free(seq)

    # -- block pool ----------------------------------------------------------
    def _ref(self, block: int) -> None:
        if self._refs[block] == 0:
            self._evictable.pop(block, None)
        self._refs[block] += 1

    def _take_block(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)  # least recently released
            key = self._key_of.pop(block)
            del self._block_of[key]
            self.counters.evictions += 1
        self._refs[block] = 1
        return block

    def _release_block(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] > 0:
            return
        if block in self._key_of:
            self._evictable[block] = None
            self._evictable.move_to_end(block)
        else:
            self._free.append(block)

    def reset(self) -> int:
        """Forget every unreferenced cached block; returns how many were dropped."""
        dropped = 0
        while self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._key_of.pop(block)]
            self._free.append(block)
            dropped += 1
        return dropped

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
