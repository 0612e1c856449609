"""The engine with the prefix-cache manager on a tiny pool: pinned prefixes of waiting requests never deadlock."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from mindie_host.api import Host, SamplingParams, config_from_dict
from mindie_host.testing import load_host, make_tiny_llama, server_config


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-prefix-engine"))


def _host(model: Path, on: bool) -> Host:
    cfg = server_config(model, schedule={"cacheBlockSize": 16, "maxBatchSize": 4, "maxPrefillBatchSize": 4,
                                         "maxIterTimes": 64, "enablePrefixCache": on},
                        model={"plugin_params": json.dumps({"plugin_type": "prefix_cache"})} if on else {},
                        deploy={"maxSeqLen": 256, "maxInputTokenLen": 240},
                        plugins={"prefix_cache": {"numBlocks": 16}} if on else {})
    config = config_from_dict(cfg)
    config.server.engineProcess = False  # the test steps host.llm itself
    host = load_host(config)
    return host


def _run(host: Host, prompts: list[list[int]], tag: str) -> dict[str, list[int]]:
    """Queue every prompt at once and step the engine until all finish (bounded: a deadlock fails)."""
    llm = host.llm
    assert llm is not None
    for i, ids in enumerate(prompts):
        sampling = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        llm.add_request(host.new_request(protocol="test", body={}, sampling=sampling, prompt_token_ids=ids,
                                         request_id=f"{tag}-{i}"))
    done: dict[str, list[int]] = {}
    for _ in range(500):
        for out in llm.step():
            if out.finished:
                assert out.finish_reason == "length", out.error
                done[out.request_id] = out.token_ids
        if not llm.has_work():
            return done
    raise AssertionError(f"engine made no progress: {llm.stats()}")


def test_waiting_requests_pinning_the_pool_do_not_deadlock(tiny_model: Path) -> None:
    rng = random.Random(3)
    x, y, z = ([rng.randrange(1000, 20000) for _ in range(80)] for _ in range(3))  # 5 full blocks each
    tails = [[rng.randrange(1000, 20000) for _ in range(150)] for _ in range(3)]
    warm = [x, y, z]
    # z + 150 tokens needs 10 new blocks; x', y' pin 5 cached blocks each: 15 of 16 blocks are pinned
    burst = [z + tails[0], x + tails[1][:20], y + tails[2][:20]]
    on = _host(tiny_model, on=True)
    try:
        for i, ids in enumerate(warm):
            _run(on, [ids], f"warm{i}")
        assert on.stats()["prefix_cache_cached_blocks"] == 15
        got = _run(on, burst, "burst")
    finally:
        on.shutdown()
    off = _host(tiny_model, on=False)
    try:
        want = _run(off, burst, "burst")
    finally:
        off.shutdown()
    assert got == want
