"""The builtin scheduling policies and the Standard planner, on real engine sequences and KV accounting."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from mindie_host.api import (
    EngineRequest,
    KVCacheManager,
    SamplingParams,
    SchedulerLimits,
    SchedulerState,
    plan_standard,
)
from mindie_host.cli import build_config, parser
from mindie_host.config import config_from_dict, default_config_dict
from mindie_host.engine.scheduler import Scheduler
from mindie_host.engine.sequence import Sequence, SequenceStatus
from mindie_host.engine.skip_join import SkipJoinMLFQ
from mindie_host.plugins import PluginHost


def seq(i: int, prompt_len: int, arrival: float, priority: int = 3, max_new: int = 16) -> Sequence:
    req = EngineRequest(f"r{i}", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_new), priority=priority,
                        arrival_time=arrival)
    return Sequence(i, req, max_new)


def limits(**kw: object) -> SchedulerLimits:
    base = dict(max_batch_size=8, max_prefill_batch_size=4, max_prefill_tokens=64, max_queue_delay_s=0.005)
    base.update(kw)
    return SchedulerLimits(**base)  # type: ignore[arg-type]


def config_with(**schedule: object):
    data = default_config_dict()
    data["BackendConfig"]["ScheduleConfig"].update(schedule)
    return config_from_dict(data)


def order_waiting(waiting: list[Sequence], **schedule: object) -> list[int]:
    plugins = PluginHost()
    plugins.bind(config_with(**schedule))
    ordered = plugins.hook.mindie_host_order_waiting(waiting=waiting, now=0.0)
    return [s.seq_id for s in ordered]


def test_order_policies() -> None:
    waiting = [seq(0, 30, 1.0, priority=4), seq(1, 5, 2.0, priority=1), seq(2, 60, 3.0, priority=2)]
    assert order_waiting(waiting) == order_waiting(waiting, prefillPolicyType=1) == [0, 1, 2]
    assert order_waiting(waiting, prefillPolicyType=2) == [1, 2, 0]
    assert order_waiting(waiting, policyType=4) == [1, 0, 2]
    assert order_waiting(waiting, policyType=5) == [2, 0, 1]
    # Skip-Join MLFQ: queues 5, 3 and 6 by prompt length (the first quantum covering the prompt: 32, 8, 64)
    assert order_waiting(waiting, policyType=6) == [1, 0, 2]
    waiting[2].num_preemptions = 1
    assert order_waiting(waiting, prefillPolicyType=3) == [0, 1, 2]
    waiting[0].num_preemptions = 2
    assert order_waiting(waiting, prefillPolicyType=3) == [1, 2, 0]


class Sim:
    """The engine's scheduler and the builtin policy hooks stepping sequences without a model, one second a step:
    each step's plan is taken as computed, a sequence whose tokens are all computed gets its next token, and one
    with ``max_new`` tokens finishes. The KV pool has ``blocks`` blocks of 2 tokens."""

    def __init__(self, blocks: int, **schedule: object) -> None:
        config = config_with(cacheBlockSize=2, maxPrefillBatchSize=0, **schedule)
        self.plugins = PluginHost()
        self.plugins.bind(config)
        self.scheduler = Scheduler(KVCacheManager(blocks, 2), SchedulerLimits.from_schedule(config.schedule),
                                   self.plugins.hook, config, None, Counter())  # type: ignore[arg-type]
        self.now = 3.0  # the requests arrive at -1 to 2

    def run(self, seqs: list[Sequence], later: dict[int, list[Sequence]] | None = None) -> list[str]:
        """Each step's plan (request ids, in plan order) until every sequence finished; ``later[k]`` arrive just
        before step ``k``."""
        for s in seqs:
            self.scheduler.add(s)
        steps: list[str] = []
        while (self.scheduler.has_work() or later) and len(steps) < 50:
            for s in (later or {}).pop(len(steps), []):
                s.arrival_time = self.now - 0.5
                self.scheduler.add(s)
            plan = self.scheduler.schedule(self.now)
            self.scheduler.mark_computed(plan)
            for s, _ in plan.scheduled:
                if s.num_uncomputed == 0:
                    s.token_ids.append(7)  # type: ignore[attr-defined]
                    if s.num_output_tokens >= s.max_new_tokens:
                        self.scheduler.finish(s, "length")  # type: ignore[arg-type]
            steps.append(" ".join(s.request_id for s, _ in plan.scheduled))
            self.now += 1.0
        return steps


def history(prompt_len: int, arrival: float, name: str, max_new: int, preempted: int = 0) -> Sequence:
    s = seq(int(arrival * 10) + 100, prompt_len, arrival, max_new=max_new)
    s.request_id, s.num_preemptions = name, preempted
    return s


def preempted_beside_fresh() -> list[Sequence]:
    """d and c arrived first but were preempted before (twice, once); a and b are fresh. 2-token prompts, 4 new
    tokens each: in an 8-block pool all four fit until their fifth token, when one must give its blocks back."""
    return [history(2, -1.0, "d", 4, preempted=2), history(2, 0.0, "c", 4, preempted=1),
            history(2, 1.0, "a", 4), history(2, 2.0, "b", 4)]


@pytest.mark.parametrize(
    ("schedule", "steps"),
    [
        # FCFS: the running batch in admission order; at the fifth token the pool is dry: d finds no block and the
        # builtin victim, the latest arrival, is b; then a finds none and only itself is left to give way
        ({}, ["d c a b", "d c a b", "d c a b", "d c", "a b"]),
        # STATE: the never-preempted a and b first, then d and c by arrival; the victims come from the end: c, then d
        ({"decodePolicyType": 1}, ["d c a b", "a b d c", "a b d c", "a b", "d c"]),
        # MLFQ (FCFS and STATE combined): one queue per preemption count, so c (once) before d (twice); d gives way
        # first, then c; FCFS admission brings them back by arrival
        ({"decodePolicyType": 3}, ["d c a b", "a b c d", "a b c d", "a b", "d c"]),
        # ... and with MLFQ at prefill too, admission follows the same queues (then c has been preempted twice, d
        # three times)
        ({"decodePolicyType": 3, "prefillPolicyType": 3}, ["a b c d", "a b c d", "a b c d", "a b", "c d"]),
        # STATE at prefill is FCFS, as the spec defines it
        ({"decodePolicyType": 1, "prefillPolicyType": 1}, ["d c a b", "a b d c", "a b d c", "a b", "d c"]),
    ],
)
def test_decode_policies_follow_a_hand_worked_schedule(schedule: dict[str, int], steps: list[str]) -> None:
    assert Sim(8, maxBatchSize=4, **schedule).run(preempted_beside_fresh()) == steps


def test_skip_join_mlfq_follows_a_hand_worked_schedule() -> None:
    """maxBatchSize 2; L (8-token prompt, arrived first) joins queue 3, s1 (1 token) queue 0, s2 (2 tokens) queue 1.

    s1 and s2 run first; with 4 new tokens s2 has been served 2+4 units and falls to queue 3 (beyond its quanta
    2+4), where L, which arrived earlier, comes first: L is prefilled (step 5). L's 8+1 units put it in queue 4, so s1
    and s2 are the two served next, and L, holding its blocks, is paused until they finish."""
    seqs = [history(8, 0.0, "L", 2), history(1, 1.0, "s1", 6), history(2, 2.0, "s2", 6)]
    assert Sim(64, maxBatchSize=2, policyType=6).run(seqs) == [
        "s1 s2", "s1 s2", "s1 s2", "s1 s2", "L", "s1 s2", "s1 s2", "L"]
    # FCFS on the same requests: L and s1 first, s2 once s1 is done
    seqs = [history(8, 0.0, "L", 2), history(1, 1.0, "s1", 6), history(2, 2.0, "s2", 6)]
    assert Sim(64, maxBatchSize=2).run(seqs) == ["L s1", "L s1", "s2", "s1 s2", "s1 s2", "s1 s2", "s1 s2", "s2"]


@pytest.mark.parametrize(
    ("select", "steps"),
    [
        # off: a waiting prompt past maxQueueDelay is prefilled at once
        (False, ["a b", "a b", "c", "a b c", "a b", "a b", "a b", "a b", "a b"]),
        # on (spec's rule, prefillTimeMsPerReq 150, decodeTimeMsPerReq 50, maxBatchSize 4): c would make 2 decodes wait
        # 300 ms; decodes run until their waste, 50 x (4 - 2) a step, reaches that: 100, 200, 300, then c's prefill
        (True, ["a b", "a b", "a b", "a b", "a b", "c", "a b c", "a b", "a b"]),
    ],
)
def test_support_select_batch_follows_a_hand_worked_schedule(select: bool, steps: list[str]) -> None:
    sim = Sim(64, maxBatchSize=4, supportSelectBatch=select)
    assert sim.run([history(2, 0.0, "a", 8), history(2, 1.0, "b", 8)], later={2: [history(2, 2.0, "c", 2)]}) == steps


def test_skip_join_mlfq_does_not_thrash_under_a_dry_pool() -> None:
    """A closed loop of 48 jobs (prompts 4-30 tokens, 6-16 new, 16 at a time) on 8 places and 48 blocks of 2 tokens:
    the pool runs dry and TTFTs pass the 10 s starvation guard. Every job finishes, every step computes something,
    no step that admits a job preempts one that holds KV, and the preemptions (each for a served job's next token)
    stay bounded; before, admissions recomputed paused jobs that starved, were promoted and evicted others: 224
    preemptions and 414 steps, where FCFS takes 10 and 179."""
    rng = random.Random(0)
    sim = Sim(48, maxBatchSize=8, policyType=6)
    scheduler, counters = sim.scheduler, sim.scheduler.counters
    pending = [history(rng.randint(4, 30), 0.0, f"j{i}", rng.randint(6, 16)) for i in range(48)]
    for i, s in enumerate(pending):
        s.seq_id = i
    finished = steps = 0
    while finished < 48 and steps < 1000:
        while len(scheduler.by_request) < 16 and pending:
            job = pending.pop(0)
            job.arrival_time = sim.now - 0.5
            scheduler.add(job)
        before = counters["preemptions"]
        plan = scheduler.schedule(sim.now)
        assert plan.scheduled, f"step {steps} computes nothing"
        if any(s.num_computed == 0 for s, _ in plan.scheduled):  # admits a job (new, or to recompute)
            assert counters["preemptions"] == before, f"step {steps} recomputes a job to admit another"
        scheduler.mark_computed(plan)
        for s, _ in plan.scheduled:
            if s.num_uncomputed == 0:
                s.token_ids.append(7)  # type: ignore[attr-defined]
                if s.num_output_tokens >= s.max_new_tokens:
                    scheduler.finish(s, "length")  # type: ignore[arg-type]
                    finished += 1
        steps += 1
        sim.now += 1.0
    assert finished == 48 and steps < 250
    assert counters["preemptions"] <= 24


def test_skip_join_mlfq_promotes_a_starving_job() -> None:
    mlfq = SkipJoinMLFQ(starve_limit_s=10.0)
    long = seq(0, 64, arrival=100.0)
    assert mlfq.queue(long, 109.0) == 6  # joined queue 6 (a 64-token first iteration)
    assert mlfq.queue(long, 110.0) == 0  # waited 10 s: promoted to queue 0, its quanta restart there
    long.token_ids += [7] * 2  # served its prompt and 2 tokens since: 2 units beyond the promotion ...
    mlfq.promoted_at[long.request_id] = 64
    assert mlfq.queue(long, 111.0) == 1  # ... past queue 0's single unit
    mlfq.forget(long.request_id)
    assert not mlfq.last_run and not mlfq.promoted_at


def test_prefill_batch_respects_token_and_count_limits() -> None:
    kv = KVCacheManager(64, 16)
    waiting = [seq(i, 20, float(i)) for i in range(6)]
    plan = plan_standard(SchedulerState([], waiting, kv, limits(), None, now=10.0))
    # 64-token budget: three 20-token prompts; the fourth would exceed it
    assert [s.seq_id for s, _ in plan.scheduled] == [0, 1, 2]
    plan = plan_standard(SchedulerState([], waiting, kv, limits(max_prefill_tokens=4096), None, now=10.0))
    assert len(plan.scheduled) == 4  # maxPrefillBatchSize


def test_first_prompt_always_admitted_even_over_budget() -> None:
    kv = KVCacheManager(64, 16)
    plan = plan_standard(SchedulerState([], [seq(0, 200, 0.0)], kv, limits(), None, now=1.0))
    assert [(s.seq_id, n) for s, n in plan.scheduled] == [(0, 200)]


def running(i: int) -> Sequence:
    s = seq(100 + i, 8, 0.0)
    s.status = SequenceStatus.RUNNING
    s.num_computed = 8
    s.token_ids.append(7)  # one sampled token waiting to be computed
    return s


def test_queue_delay_lets_a_prefill_batch_fill_while_decodes_run() -> None:
    kv = KVCacheManager(64, 16)
    run = [running(0), running(1)]
    young = [seq(0, 10, arrival=9.999)]
    plan = plan_standard(SchedulerState(run, young, kv, limits(), None, now=10.0))
    assert all(s in run for s, _ in plan.scheduled)  # a decode step: the new request waits < 5 ms
    plan = plan_standard(SchedulerState(run, young, kv, limits(), None, now=10.01))
    assert [s.seq_id for s, _ in plan.scheduled] == [0]  # waited past maxQueueDelay: prefill now


def test_full_batch_decodes_instead_of_prefilling() -> None:
    kv = KVCacheManager(64, 16)
    run = [running(i) for i in range(2)]
    plan = plan_standard(SchedulerState(run, [seq(0, 10, 0.0)], kv, limits(max_batch_size=2), None, now=10.0))
    assert {s.seq_id for s, _ in plan.scheduled} == {100, 101}


def test_select_batch_alternates_by_waste() -> None:
    kv = KVCacheManager(64, 16)
    run = [running(i) for i in range(2)]
    lim = limits(support_select_batch=True, prefill_time_ms_per_req=150, decode_time_ms_per_req=50)
    memo: dict[str, float] = {}
    kinds = []
    for _ in range(4):
        plan = plan_standard(SchedulerState(run, [seq(0, 10, 0.0)], kv, lim, None, now=10.0, memo=memo))
        kinds.append("prefill" if plan.scheduled[0][0].seq_id == 0 else "decode")
    # prefill wait 300 ms > waste (0, then 300 after one under-full decode) -> decode, then prefill
    assert kinds[:2] == ["decode", "prefill"]


def test_cli_model_flag_builds_config(tiny_model: Path) -> None:
    args = parser().parse_args(["serve", "--model", str(tiny_model), "--port", "18001", "--plugins", "prefix_cache"])
    cfg = build_config(args)
    assert cfg.model.modelWeightPath == str(tiny_model) and cfg.model.modelName == tiny_model.name
    assert cfg.server.port == 18001 and cfg.model.plugins == ["prefix_cache"]
