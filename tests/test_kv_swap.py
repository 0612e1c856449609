"""Swap preemption: with maxPreemptCount > 0 a preempted sequence's KV goes to the CPU swap space (cpuMemSize)
and comes back, instead of being recomputed; at most maxPreemptCount swaps per step, the rest recompute."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from mindie_host.api import EngineRequest, SamplingParams
from mindie_host.testing import RunningServer, loaded_host, run_engine, server_config


def _config(model: Path, preempt: int, **extra: Any) -> dict[str, Any]:
    return server_config(model, model={"maxKvBlocks": 8, "cpuMemSize": 1},
                         deploy={"maxSeqLen": 128, "maxInputTokenLen": 64},
                         schedule={"cacheBlockSize": 16, "maxBatchSize": 8, "maxPrefillBatchSize": 8,
                                   "maxIterTimes": 100, "maxPrefillTokens": 4096, "maxPreemptCount": preempt},
                         **extra)


def _requests() -> list[EngineRequest]:
    return [EngineRequest(f"p{i}", list(range(200 + 7 * i, 240 + 7 * i)),
                          SamplingParams(max_tokens=60, ignore_eos=True)) for i in range(4)]


def _run_recording(host: Any, reqs: list[EngineRequest]) -> tuple[dict[str, Any], list[dict[str, float]]]:
    llm, outs, trace = host.llm, {}, []
    for req in reqs:
        llm.add_request(req)
    before = 0.0
    while llm.has_work():
        for out in llm.step():
            if out.finished:
                outs[out.request_id] = out
        stats = llm.stats()
        trace.append({"swapped_now": stats["num_swapped"], "usage": stats["swap_usage"],
                      "swaps_in_step": stats.get("swapped_out", 0.0) - before})
        before = stats.get("swapped_out", 0.0)
    return outs, trace


def test_swapped_sequences_come_back_with_the_same_greedy_tokens(tiny_model: Path) -> None:
    host = loaded_host(_config(tiny_model, preempt=4))
    try:
        assert host.llm.scheduler.swap is not None
        outs, trace = _run_recording(host, _requests())
        counters = host.llm.counters
        assert counters["swapped_out"] > 0 and counters["swapped_in"] == counters["swapped_out"]
        assert counters["preemptions"] == counters["swapped_out"]  # nothing was recomputed
        assert max(t["swapped_now"] for t in trace) > 0 and max(t["usage"] for t in trace) > 0
        assert host.llm.scheduler.swap.pool.num_free() == host.llm.scheduler.swap.pool.num_blocks  # all swap blocks back
        assert host.llm.kv.num_used_blocks() == 0
        for req in _requests():
            alone = run_engine(host, [EngineRequest("alone", req.prompt_token_ids, req.sampling)])["alone"]
            assert outs[req.request_id].token_ids == alone.token_ids
            assert outs[req.request_id].finish_reason == "length"
    finally:
        host.shutdown()


def test_max_preempt_count_limits_swaps_per_step_and_the_rest_recompute(tiny_model: Path) -> None:
    host = loaded_host(_config(tiny_model, preempt=1))
    try:
        outs, trace = _run_recording(host, [*_requests(), *[EngineRequest(f"q{i}", list(range(300 + i, 340 + i)),
                                                          SamplingParams(max_tokens=60, ignore_eos=True))
                                            for i in range(2)]])
        assert max(t["swaps_in_step"] for t in trace) == 1
        assert host.llm.counters["swapped_out"] > 0 and len(outs) == 6
    finally:
        host.shutdown()


def test_without_max_preempt_count_preemption_recomputes(tiny_model: Path) -> None:
    host = loaded_host(_config(tiny_model, preempt=0))
    try:
        assert host.llm.scheduler.swap is None
        run_engine(host, _requests())
        assert host.llm.counters["preemptions"] > 0 and host.llm.counters["swapped_out"] == 0
    finally:
        host.shutdown()


def test_swap_gauges_reach_prometheus(tiny_model: Path) -> None:
    cfg = _config(tiny_model, preempt=4)
    cfg["ServerConfig"]["engineProcess"] = False  # the test takes a block of the engine's swap space itself
    with RunningServer(cfg) as server:
        server.host.llm.scheduler.swap.pool.allocate()  # one block in use: usage 1 / blocks
        text = httpx.get(server.metrics_url + "/metrics", timeout=30).text
        usage = next(line for line in text.splitlines() if line.startswith("cpu_cache_usage_perc"))
        assert float(usage.split()[-1]) == pytest.approx(1 / server.host.llm.scheduler.swap.pool.num_blocks)
        assert any(line.startswith("num_requests_swapped") for line in text.splitlines())
