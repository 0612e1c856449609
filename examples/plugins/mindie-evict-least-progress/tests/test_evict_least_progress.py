"""The example eviction policy: under KV pressure the engine asks it which sequence to preempt."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mindie_evict_least_progress as plugin
import pytest

from mindie_host.api import EngineContext, EngineRequest, PluginError, SamplingParams, hookimpl
from mindie_host.testing import loaded_host, make_tiny_llama, run_engine, server_config


class VictimRecorder:
    """Wraps the hook to record each choice with the candidates it was chosen from."""

    def __init__(self) -> None:
        self.choices: list[tuple[list[tuple[int, int, int]], int]] = []

    @hookimpl(wrapper=True)
    def mindie_host_preemption_victim(self, ctx: EngineContext, running: list[Any]) -> Any:
        victim = yield
        self.choices.append(([(s.seq_id, s.priority, s.num_computed) for s in running], victim.seq_id))
        return victim


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("evict"))


def _config(model: Path, **plugins: Any) -> dict[str, Any]:
    return server_config(model, model={"maxKvBlocks": 8}, deploy={"maxSeqLen": 128, "maxInputTokenLen": 64},
                         schedule={"cacheBlockSize": 16, "maxBatchSize": 8, "maxPrefillBatchSize": 8,
                                   "maxIterTimes": 100, "maxPrefillTokens": 4096}, plugins=plugins)


def _requests() -> list[EngineRequest]:
    # prompts of different lengths, so the running sequences have computed different amounts
    return [EngineRequest(f"p{i}", list(range(200 + 7 * i, 200 + 7 * i + 16 + 12 * i)),
                          SamplingParams(max_tokens=50, ignore_eos=True)) for i in range(4)]


def test_the_plugin_chooses_the_sequence_with_the_least_work(tiny_model: Path) -> None:
    recorder = VictimRecorder()
    host = loaded_host(_config(tiny_model), plugins=[(plugin, "evict_least_progress"), (recorder, "recorder")])
    try:
        outs = run_engine(host, _requests())
        assert host.llm.counters["preemptions"] > 0 and recorder.choices
        for candidates, chosen in recorder.choices:
            lowest = max(p for _, p, _ in candidates)
            least = min(c for _, p, c in candidates if p == lowest)
            assert (chosen, lowest, least) in [(s, p, c) for s, p, c in candidates]
        for req in _requests():  # recomputation keeps every output identical to a run alone
            alone = run_engine(host, [EngineRequest("alone", req.prompt_token_ids, req.sampling)])["alone"]
            assert outs[req.request_id].token_ids == alone.token_ids
    finally:
        host.shutdown()


def test_bad_params_stop_startup(tiny_model: Path) -> None:
    with pytest.raises(PluginError, match=r"Plugins\.evict_least_progress\.respectPriority: got 'maybe'"):
        loaded_host(_config(tiny_model, evict_least_progress={"respectPriority": "maybe"}),
                    plugins=[(plugin, "evict_least_progress")])
