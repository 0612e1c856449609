"""Block accounting of PrefixCachingKVCacheManager: sharing, ref counts, LRU eviction, keys."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from mindie_plugin_prefix_cache import PrefixCachingKVCacheManager, block_key
from mindie_plugin_prefix_cache.manager import ROOT_KEY

BS = 4


@dataclass
class Seq:
    """A sequence as the engine shows it to KV managers (the SequenceView fields they read)."""

    seq_id: int
    token_ids: list[int]
    cache_salt: str | None = None
    num_computed: int = 0
    request_id: str = ""
    prompt_len: int = 0
    priority: int = 3
    arrival_time: float = 0.0
    num_preemptions: int = 0
    max_new_tokens: int = 16
    extra: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed


def run_prefill(kv: PrefixCachingKVCacheManager, seq: Seq) -> int:
    """Admit ``seq`` the way the engine does: match (pure), acquire on admission, allocate the rest, compute."""
    matched = kv.match_prefix(seq)
    seq.num_computed = kv.acquire_prefix(seq)
    assert seq.num_computed == matched  # nothing was evicted in between
    hit = seq.num_computed
    n = seq.num_uncomputed
    assert kv.can_allocate(seq, n)
    kv.allocate(seq, n)
    seq.num_computed += n
    kv.on_computed(seq)
    return hit


def test_shared_prefix_reuses_whole_blocks_only() -> None:
    kv = PrefixCachingKVCacheManager(32, BS)
    a = Seq(0, list(range(10)))  # 2 full blocks + 2 tokens
    assert run_prefill(kv, a) == 0
    b = Seq(1, [*range(10), 99, 98])  # shares 10 tokens: only the 2 whole blocks count
    assert run_prefill(kv, b) == 8
    assert kv.block_table(b)[:2] == kv.block_table(a)[:2]
    assert kv.block_table(b)[2] != kv.block_table(a)[2]
    assert kv.counters.hit_blocks == 2


def test_divergence_inside_a_block_stops_the_match_at_that_block() -> None:
    kv = PrefixCachingKVCacheManager(32, BS)
    run_prefill(kv, Seq(0, list(range(16))))
    c = Seq(1, [*range(6), 500, *range(7, 16)])  # differs at token 6, inside block 1
    assert run_prefill(kv, c) == 4


def test_full_prompt_is_never_reused_entirely() -> None:
    kv = PrefixCachingKVCacheManager(32, BS)
    run_prefill(kv, Seq(0, list(range(12))))
    again = Seq(1, list(range(12)))
    assert run_prefill(kv, again) == 8  # the last block is recomputed to get logits
    assert again.num_uncomputed == 0


def test_salt_separates_the_cache() -> None:
    kv = PrefixCachingKVCacheManager(32, BS)
    run_prefill(kv, Seq(0, list(range(9))))
    assert run_prefill(kv, Seq(1, list(range(9)), cache_salt='{"lora":"sql"}')) == 0
    assert run_prefill(kv, Seq(2, list(range(9)), cache_salt="tenant-a")) == 0
    assert run_prefill(kv, Seq(3, list(range(9)), cache_salt='{"lora":"sql"}')) == 8
    assert block_key(ROOT_KEY, [1], None) != block_key(ROOT_KEY, [1], "")
    assert block_key(ROOT_KEY, [1, 2], None) != block_key(block_key(ROOT_KEY, [0], None), [1, 2], None)


def test_ref_counts_and_lru_eviction_only_under_pressure() -> None:
    kv = PrefixCachingKVCacheManager(6, BS)
    a = Seq(0, list(range(9)))  # 3 blocks, 2 of them full (cacheable)
    run_prefill(kv, a)
    b = Seq(1, [*range(8), 7])
    run_prefill(kv, b)  # shares a's 2 full blocks
    shared = kv.block_table(a)[0]
    assert kv.num_free_blocks() == 6 - 4
    kv.free(a)
    assert kv.num_free_blocks() == 3  # a's private last block; shared blocks still held by b
    kv.free(b)
    assert kv.num_free_blocks() == 6  # cached blocks count as free ...
    assert kv.num_cached_blocks() == 2  # ... but keep their contents
    assert kv.counters.evictions == 0
    c = Seq(2, list(range(100, 109)))  # 3 blocks; 4 plain free blocks remain (+2 evictable)
    run_prefill(kv, c)
    assert kv.counters.evictions == 0  # free blocks were used first
    d = Seq(3, list(range(200, 209)))  # needs 3 blocks, 1 free + 2 evictable: evicts
    run_prefill(kv, d)
    assert kv.counters.evictions == 2
    assert shared in kv.block_table(d)
    assert kv.num_cached_blocks() == 2 + 2 + 2 - 2  # c's and d's full blocks replaced a's


def test_lru_evicts_least_recently_released_and_tail_first() -> None:
    kv = PrefixCachingKVCacheManager(5, BS)
    old = Seq(0, list(range(9)))
    run_prefill(kv, old)
    kv.free(old)  # 2 cached blocks released (tail first)
    new = Seq(1, list(range(50, 55)))
    run_prefill(kv, new)
    kv.free(new)  # 1 more cached block, released later
    hog = Seq(2, list(range(300, 313)))  # 4 blocks: 2 free + 2 evicted
    run_prefill(kv, hog)
    assert kv.counters.evictions == 2
    # old's tail block went first, then old's head (released before new's block)
    kv.free(hog)
    probe = Seq(3, list(range(50, 55)))
    assert run_prefill(kv, probe) == 4


def test_match_is_a_pure_query_and_acquire_pins() -> None:
    kv = PrefixCachingKVCacheManager(8, BS)
    run_prefill(kv, Seq(0, list(range(9))))
    kv.free(Seq(0, []))
    waiting = Seq(1, list(range(9)))
    assert kv.match_prefix(waiting) == 8
    assert kv.num_free_blocks() == 8 and kv.block_table(waiting) == []  # matching holds nothing
    assert kv.counters.queried_blocks == 3  # ... and counts nothing: only the first admission did
    assert kv.acquire_prefix(waiting) == 8
    assert kv.num_free_blocks() == 6  # the two matched blocks are held now
    assert [kv.pool.ref_count(b) for b in kv.block_table(waiting)] == [1, 1]
    kv.free(waiting)
    assert kv.num_free_blocks() == 8
    assert kv.reset() == 2
    assert kv.num_cached_blocks() == 0


def test_blocks_evicted_between_match_and_acquire_are_recomputed() -> None:
    kv = PrefixCachingKVCacheManager(4, BS)
    run_prefill(kv, Seq(0, list(range(9))))
    kv.free(Seq(0, []))  # 2 cached blocks, evictable
    waiting = Seq(1, list(range(9)))
    assert kv.match_prefix(waiting) == 8
    hog = Seq(2, list(range(100, 112)))  # takes the 2 free blocks and evicts the cached head's tail
    hog.num_computed = kv.acquire_prefix(hog)
    kv.allocate(hog, 12)
    assert kv.counters.evictions == 1
    assert kv.acquire_prefix(waiting) == 4  # only the first block survived


def test_the_manager_uses_only_the_public_pool() -> None:
    """prefix_cache extends the builtin manager through public methods: no private attribute of a host class."""
    import ast
    import inspect

    import mindie_plugin_prefix_cache.manager as manager

    private = {node.attr for node in ast.walk(ast.parse(inspect.getsource(manager)))
               if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")}
    assert private <= {"_chain", "_keys", "_cached_run"}, private  # its own


def test_allocate_beyond_pool_raises() -> None:
    kv = PrefixCachingKVCacheManager(2, BS)
    s = Seq(0, list(range(12)))
    assert not kv.can_allocate(s, 12)
    with pytest.raises(MemoryError):
        kv.allocate(s, 12)


def test_free_tail_releases_the_blocks_of_taken_back_tokens_and_keeps_the_keyed_ones() -> None:
    kv = PrefixCachingKVCacheManager(16, BS)
    s = Seq(0, list(range(10)))  # 2 full blocks (keyed once computed) + 2 tokens
    run_prefill(kv, s)
    held = kv.block_table(s)
    free = kv.num_free_blocks()
    s.token_ids += [50, 51, 52, 53, 54, 55]  # six draft tokens: KV for them is written ...
    kv.allocate(s, 6)
    assert len(kv.block_table(s)) == 4 and kv.num_free_blocks() == free - 1
    s.num_computed += 1  # ... and only the first is accepted
    del s.token_ids[11:]
    kv.on_computed(s)
    kv.free_tail(s)
    assert kv.block_table(s) == held and kv.num_free_blocks() == free
    assert kv.num_cached_blocks() == 2
    kv.free_tail(Seq(7, [1, 2]))  # a sequence holding nothing: nothing to do
