"""Tensor parallelism (worldSize > 1): real rank processes on gloo, against worldSize 1.

Greedy output (fp32, quantization none) must be token-identical to one rank: on random tiny
Llamas with TP 2 and TP 4 (with prefix_cache, splitfuse and llma's speculative drafts on), and on the default model with
TP 3 (9 attention heads, 3 KV heads). Bad world sizes and device lists are refused at startup,
naming the key and the allowed values. SIGKILL of one rank under load: every request is
answered, and the supervisor restarts all ranks together.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from mindie_host.distributed.tensor_parallel import TensorParallel
from mindie_host.engine.request import EngineRequest
from mindie_host.engine.sampling import SamplingParams
from mindie_host.models.weights import iter_weights, load_arch, resolve_model
from mindie_host.plugins import PluginError
from mindie_host.testing import (
    RunningServer,
    loaded_host,
    make_tiny_llama,
    rank_pids,
    release_memory,
    run_engine,
    server_config,
    wait_for,
)

CLIENT_TIMEOUT = 90.0
#: prefix_cache and splitfuse, and llma's drafts verified beside them (every rank computes the verification rows)
PLUGINS = {"plugin_params": json.dumps({"plugin_type": "prefix_cache,splitfuse,llma"})}
LLMA = {"llma": {"numSpeculativeTokens": 4, "minNgram": 1, "maxBatchSize": 16}}
SPLIT = {"templateType": "Mix", "enableSplit": True, "enablePrefixCache": True, "splitChunkTokens": 16, "splitStartBatchSize": 0}


@pytest.fixture(scope="module")
def tiny8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 attention heads, 4 KV heads: TP 1, 2 and 4 divide it."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-tp"), num_heads=8, num_kv_heads=4, hidden_size=64,
                           intermediate_size=128)


def _config(path: Path | None, world: int, **extra: Any) -> dict[str, Any]:
    model_keys = {"worldSize": world, "dtype": "float32", "quantization": "none", **extra.pop("model", {})}
    cfg = server_config(path, model=model_keys, **extra)
    cfg["BackendConfig"]["npuDeviceIds"] = [list(range(world))]
    return cfg


def _greedy(cfg: dict[str, Any], prompts: list[list[int]], max_tokens: int,
            stats: dict[str, float] | None = None) -> dict[str, list[int]]:
    """Greedy tokens of each prompt, in one batch; the engine's counters go to ``stats``."""
    release_memory()  # the host of the call before (reference cycles): the one-rank default model holds 3.4 GB
    host = loaded_host(cfg)
    try:
        reqs = [EngineRequest(f"r{i}", p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
                for i, p in enumerate(prompts)]
        out = {k: v.token_ids for k, v in run_engine(host, reqs).items()}
        if stats is not None:
            stats.update(host.llm.stats())
        return out
    finally:
        host.shutdown()


def _prompts() -> list[list[int]]:
    shared = list(range(100, 140))  # a shared prefix: prefix_cache serves it from the second request on
    return [shared + list(range(7 * i + 3, 7 * i + 3 + 5 + 9 * i)) for i in range(6)] + [list(range(50, 90))]


@pytest.mark.parametrize("world", [2, 4])
def test_tiny_llama_is_token_identical_to_one_rank_with_plugins(tiny8: Path, world: int) -> None:
    prompts = [*_prompts(), [5, 6, 7, 8] * 10]  # the last one's output falls into a loop llma copies
    reference = _greedy(_config(tiny8, 1), prompts, 20)
    plain = _greedy(_config(tiny8, world), prompts, 20)
    assert plain == reference
    stats: dict[str, float] = {}
    plugins = _greedy(_config(tiny8, world, model=PLUGINS, schedule=SPLIT, plugins=LLMA), prompts, 20, stats)
    assert plugins == reference
    assert stats["spec_accepted_tokens"] > 0 and stats["spec_draft_tokens"] > stats["spec_accepted_tokens"]


@pytest.mark.slow  # the default model on 3 ranks over 2 cores: about 40 s
def test_default_model_tp3_is_token_identical_to_one_rank() -> None:
    prompts = [[1, 504, 3575, 282, 4649, 314], [1, 563, 28263, 30, 79, 711], list(range(200, 260))]
    reference = _greedy(_config(None, 1), prompts, 16)
    assert _greedy(_config(None, 3), prompts, 16) == reference


def test_each_rank_reads_only_its_slices(tiny8: Path) -> None:
    """Safetensors and GGUF slices equal the slices of the full tensors; a rank holds 1/N of each matrix."""
    from mindie_host.models.default import default_model_path

    for path in (tiny8, default_model_path()):
        source = resolve_model(path)
        arch = load_arch(source)
        full = dict(iter_weights(source, arch))
        tp = TensorParallel(1, 3 if path != tiny8 else 2)
        held = 0
        for name, part in iter_weights(source, arch, lambda n, tp=tp, arch=arch: tp.slice_of(n, arch)):
            cut = tp.slice_of(name, arch)
            ref = full[name]
            if cut is not None:
                dim, lo, hi = cut
                ref = ref[lo:hi] if dim == 0 else ref[:, lo:hi]
            assert part.shape == ref.shape and np.array_equal(part, ref), name
            held += part.size
        total = sum(a.size for a in full.values())
        assert held < total / tp.world_size * 1.05  # norms are whole; everything else is split


def test_world_size_that_does_not_divide_the_heads_is_refused(tiny8: Path) -> None:
    with pytest.raises(PluginError) as info:
        loaded_host(_config(tiny8, 3))
    message = str(info.value)
    assert "BackendConfig.ModelDeployConfig.ModelConfig[0].worldSize: got 3" in message
    assert "8 attention heads, 4 KV heads" in message and "allowed: 1, 2, 4" in message


def test_quantized_serving_schemes_are_refused_with_tensor_parallelism(tiny8: Path) -> None:
    with pytest.raises(PluginError, match=r"quantization: got 'w8a16' .* allowed with tensor parallelism: auto, none"):
        loaded_host(_config(tiny8, 2, model={"quantization": "w8a16"}))


def _stream(url: str, results: list[dict[str, Any]]) -> None:
    body = {"model": "tiny", "prompt": "tell me a long story", "max_tokens": 600, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=CLIENT_TIMEOUT) as resp:
            results.append({"status": resp.status_code, "text": resp.read().decode()})
    except Exception as exc:  # a hang or a dropped connection: the test fails on it
        results.append({"status": None, "text": repr(exc)})


@pytest.mark.slow  # two loads of two ranks each in spawned processes
def test_sigkill_of_one_rank_fails_fast_and_all_ranks_restart(tiny8: Path) -> None:
    cfg = _config(tiny8, 2, server={"engineProcess": True, "engineRestartBackoffSeconds": 0.1})
    started = time.monotonic()
    with RunningServer(cfg, timeout=180) as srv:
        load_seconds = time.monotonic() - started
        engine, mgmt = srv.host.engine, srv.management_url
        ranks = rank_pids(engine.process.pid)
        assert len(ranks) == 1  # rank 0 is the engine process itself; rank 1 is its child
        results: list[dict[str, Any]] = []
        threads = [threading.Thread(target=_stream, args=(srv.url, results)) for _ in range(4)]
        for t in threads:
            t.start()
        wait_for(lambda: engine.num_active == 4 and engine.engine_stats.get("num_running", 0) >= 1, 30,
              "four requests running")
        old_engine = engine.process.pid
        os.kill(ranks[0], signal.SIGKILL)
        wait_for(lambda: httpx.get(f"{mgmt}/v2/health/ready").status_code == 503, 10, "readiness 503")
        for t in threads:
            t.join(CLIENT_TIMEOUT + 5)
        assert len(results) == 4
        for r in results:  # each stream ended: completed, or with a clear error event
            assert r["status"] == 200, r
            events = [json.loads(e[6:]) for e in r["text"].splitlines() if e.startswith("data: {")]
            last = events[-1]
            if "error" in last:
                assert "tensor-parallel ranks died" in json.dumps(last["error"]), last
            else:
                assert last["choices"][0]["finish_reason"] == "length"
        back = wait_for(lambda: httpx.get(f"{mgmt}/v2/health/ready").status_code == 200, load_seconds + 30,
                     "readiness 200 after the restart")
        assert back < load_seconds + 30 and engine.restarts == 1
        assert engine.process.pid != old_engine and len(rank_pids(engine.process.pid)) == 1
        again = httpx.post(f"{srv.url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4},
                           timeout=CLIENT_TIMEOUT)
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 4


def test_a_load_whose_rank_dies_leaves_no_world_behind(tiny8: Path) -> None:
    """Rank 1 is killed after the world formed, while the ranks load their slices: the load fails naming the rank,
    this process leaves the world (it used to stay in it, and every later load here failed with "trying to
    initialize the default process group twice"), and a load after it serves the one-rank tokens."""
    import multiprocessing

    import torch.distributed as dist

    from mindie_host.distributed.ranks import RankFailedError

    cfg = _config(tiny8, 2)
    failure: list[BaseException] = []

    def load() -> None:
        try:
            loaded_host(cfg).shutdown()
        except BaseException as exc:  # the failure this test causes
            failure.append(exc)

    loader = threading.Thread(target=load)
    loader.start()
    wait_for(lambda: dist.is_initialized() or not loader.is_alive(), 120, "the world to form")
    rank1 = [p for p in multiprocessing.active_children() if p.name == "mindie-rank-1"]
    assert rank1, "rank 1 was not a child of this process"
    os.kill(rank1[0].pid, signal.SIGKILL)
    loader.join(120)
    assert not loader.is_alive()
    assert len(failure) == 1 and isinstance(failure[0], RankFailedError), failure
    assert "rank 1 exited" in str(failure[0]) and "SIGKILL" in str(failure[0]), failure[0]
    assert not dist.is_initialized()
    prompts = _prompts()[:2]
    assert _greedy(_config(tiny8, 2), prompts, 6) == _greedy(_config(tiny8, 1), prompts, 6)
