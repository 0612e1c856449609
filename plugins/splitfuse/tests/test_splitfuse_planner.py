"""plan_mix on hand-built scheduler states: budget, decode-first, MindIE's split switches."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mindie_plugin_splitfuse import plan_mix

from mindie_host.api import KVCacheManager, SchedulerLimits, SchedulerState, config_from_dict
from mindie_host.testing import server_config


@dataclass
class Seq:
    """The SequenceView fields a planner reads."""

    seq_id: int
    token_ids: list[int]
    num_computed: int = 0
    request_id: str = ""
    prompt_len: int = 0
    priority: int = 3
    arrival_time: float = 0.0
    num_preemptions: int = 0
    adapter: str | None = None
    cache_salt: str | None = None
    max_new_tokens: int = 16

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def is_prefill(self) -> bool:
        return self.num_uncomputed > 1


def decoding(seq_id: int, kv: KVCacheManager) -> Seq:
    s = Seq(seq_id, list(range(10)), num_computed=9)
    kv.allocate(s, 0)
    kv.allocate(Seq(seq_id, list(range(9))), 9)
    return s


def state(running: list[Seq], waiting: list[Seq], kv: KVCacheManager | None = None,
          memo: dict[str, Any] | None = None, **schedule: Any) -> SchedulerState:
    sched = {"templateType": "Mix", "enableSplit": True, "splitChunkTokens": 16, "splitStartBatchSize": 0,
             "maxBatchSize": 8, "maxPrefillBatchSize": 0, **schedule}
    cfg = config_from_dict(server_config(None, schedule=sched,
                                         model={"plugin_params": json.dumps({"plugin_type": "splitfuse"})}))
    kv = kv or KVCacheManager(64, 4)
    limits = SchedulerLimits(max_batch_size=cfg.schedule.maxBatchSize, max_prefill_batch_size=8,
                             max_prefill_tokens=cfg.schedule.maxPrefillTokens, max_queue_delay_s=0.005)
    return SchedulerState(running=running, waiting=waiting, kv=kv, limits=limits, config=cfg, now=0.0,
                          memo={} if memo is None else memo)


def plan(st: SchedulerState) -> list[tuple[int, int]]:
    return [(s.seq_id, n) for s, n in plan_mix(st).scheduled]


def test_decodes_first_then_a_prefill_chunk_fills_the_budget() -> None:
    kv = KVCacheManager(64, 4)
    running = [decoding(i, kv) for i in range(3)]
    long = Seq(10, list(range(40)))
    assert plan(state(running, [long], kv)) == [(0, 1), (1, 1), (2, 1), (10, 13)]


def test_partial_prefill_continues_before_new_prompts() -> None:
    kv = KVCacheManager(64, 4)
    part = Seq(5, list(range(40)), num_computed=13)
    kv.allocate(Seq(5, list(range(13))), 13)
    fresh = Seq(6, list(range(8)))
    assert plan(state([part], [fresh], kv)) == [(5, 16)]
    assert plan(state([part], [fresh], kv, splitChunkTokens=40)) == [(5, 27), (6, 8)]


def test_split_waits_for_split_start_batch_size() -> None:
    kv = KVCacheManager(64, 4)
    running = [decoding(i, kv) for i in range(2)]
    long = Seq(10, list(range(40)))
    # 2 running < 3: no split; the whole prompt goes as the step's first prefill (maxPrefillTokens budget)
    assert plan(state(running, [long], kv, splitStartBatchSize=3)) == [(0, 1), (1, 1), (10, 40)]
    assert plan(state(running, [long], kv, splitStartBatchSize=2)) == [(0, 1), (1, 1), (10, 14)]


def test_split_start_type_false_keeps_splitting_once_started() -> None:
    kv = KVCacheManager(64, 4)
    memo: dict[str, Any] = {}
    running = [decoding(i, kv) for i in range(2)]
    long = Seq(10, list(range(40)))
    assert plan(state(running, [long], kv, memo, splitStartBatchSize=2)) == [(0, 1), (1, 1), (10, 14)]
    # the batch shrank below splitStartBatchSize: still splitting (splitStartType false) ...
    assert plan(state(running[:1], [long], kv, memo, splitStartBatchSize=2)) == [(0, 1), (10, 15)]
    # ... but with splitStartType true the condition is checked again
    assert plan(state(running[:1], [long], kv, memo, splitStartBatchSize=2, splitStartType=True)) == [
        (0, 1), (10, 40)]


def test_split_type_splits_only_prompts_longer_than_two_chunks() -> None:
    kv = KVCacheManager(64, 4)
    running = [decoding(0, kv)]
    medium = Seq(10, list(range(30)))  # <= 2 * 16: not split, waits behind the decode
    long = Seq(11, list(range(40)))
    assert plan(state(running, [medium], kv, splitType=True)) == [(0, 1)]
    assert plan(state(running, [long], kv, splitType=True)) == [(0, 1), (11, 15)]
    assert plan(state(running, [medium], kv, splitType=False)) == [(0, 1), (10, 15)]


def test_queue_order_is_kept_and_batch_size_is_capped() -> None:
    kv = KVCacheManager(64, 4)
    waiting = [Seq(i, list(range(3))) for i in range(10)]
    assert plan(state([], waiting, kv, splitChunkTokens=100, maxBatchSize=4)) == [(0, 3), (1, 3), (2, 3), (3, 3)]
    # enableSplit false: whole prompts only; the first may exceed the maxPrefillTokens budget, then the step is full
    big_first = [Seq(20, list(range(800))), Seq(21, list(range(2)))]
    assert plan(state([], big_first, KVCacheManager(400, 4), enableSplit=False, maxPrefillTokens=768)) == [(20, 800)]


def test_no_admission_beyond_free_blocks_while_others_run() -> None:
    kv = KVCacheManager(6, 4)
    running = [decoding(0, kv)]  # 3 blocks
    long = Seq(10, list(range(40)))  # the chunk of 15 tokens needs 4 blocks; 3 free
    assert plan(state(running, [long], kv)) == [(0, 1)]
    assert plan(state([], [long], KVCacheManager(6, 4))) == [(10, 16)]
