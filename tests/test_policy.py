"""The builtin scheduling policies and the Standard planner, on real engine sequences and KV accounting."""

from __future__ import annotations

from pathlib import Path

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
from mindie_host.engine.builtin_policy import mindie_host_order_waiting
from mindie_host.engine.sequence import Sequence, SequenceStatus


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


def test_order_policies() -> None:
    waiting = [seq(0, 30, 1.0, priority=4), seq(1, 5, 2.0, priority=1), seq(2, 60, 3.0, priority=2)]
    ids = lambda xs: [s.seq_id for s in xs]  # noqa: E731
    assert ids(mindie_host_order_waiting(waiting, config_with(), 0.0)) == [0, 1, 2]
    assert ids(mindie_host_order_waiting(waiting, config_with(prefillPolicyType=2), 0.0)) == [1, 2, 0]
    assert ids(mindie_host_order_waiting(waiting, config_with(policyType=4), 0.0)) == [1, 0, 2]
    assert ids(mindie_host_order_waiting(waiting, config_with(policyType=5), 0.0)) == [2, 0, 1]


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
