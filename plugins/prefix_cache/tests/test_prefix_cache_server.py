"""prefix_cache on a real server: greedy outputs identical with the cache on and off, metrics, config checks."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from mindie_host.api import PluginError
from mindie_host.testing import RunningServer, load_host, make_tiny_llama, server_config

BLOCK = 16
ON = {"plugin_params": json.dumps({"plugin_type": "prefix_cache"})}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama in HF format with the SmolLM2 tokenizer (defined here, not in a conftest.py,
    so this directory adds no second ``conftest`` module to the test session)."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-prefix-cache"))


def _cfg(model: Path, on: bool, num_blocks: int | None = 24, **schedule: Any) -> dict[str, Any]:
    sched = {"cacheBlockSize": BLOCK, "maxBatchSize": 4, "maxPrefillBatchSize": 4, "maxIterTimes": 64,
             "enablePrefixCache": on, **schedule}
    plugins = {"prefix_cache": {"numBlocks": num_blocks}} if on and num_blocks else {}
    return server_config(model, model=ON if on else {}, schedule=sched,
                         deploy={"maxSeqLen": 256, "maxInputTokenLen": 220}, plugins=plugins)


def _workload() -> tuple[list[tuple[list[int], int]], list[tuple[list[int], int]], list[tuple[list[int], int]]]:
    """(sequential warm-up, concurrent burst under pressure, sequential after the burst)."""
    rng = random.Random(7)

    def toks(n: int) -> list[int]:
        return [rng.randrange(1000, 20000) for _ in range(n)]

    shared = toks(100)  # 6 whole blocks + 4 tokens
    exact = toks(96)  # exactly 6 blocks
    warm = [
        (shared + toks(10), 12),
        (shared + toks(30), 12),  # reuses 6 blocks
        (shared[:40] + toks(50), 12),  # diverges at token 40, inside block 2
        (shared[:47] + toks(30), 12),  # diverges at the last token of block 2
        (exact, 12),
        (exact, 12),  # the whole prompt is cached: its last block is recomputed
    ]
    burst = [(shared + toks(rng.randrange(40, 90)), 64) for _ in range(6)]
    burst += [(toks(150), 64) for _ in range(3)]  # no shared prefix: pushes cached blocks out
    after = [(shared + toks(10), 12), (exact, 12)]
    return warm, burst, after


Output = tuple[str, list[str], list[float]]


def _complete(client: openai.OpenAI, prompt: list[int], max_tokens: int) -> Output:
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                  logprobs=1, extra_body={"ignore_eos": True})
    choice = r.choices[0]
    assert r.usage.completion_tokens == max_tokens
    return choice.text, list(choice.logprobs.tokens), list(choice.logprobs.token_logprobs)


def assert_same_outputs(on: list[Output], off: list[Output]) -> None:
    """Same tokens, and logprobs equal up to float noise: reused KV must be the KV the prompt would get."""
    assert len(on) == len(off)
    for i, ((text_on, toks_on, lp_on), (text_off, toks_off, lp_off)) in enumerate(zip(on, off)):
        assert (text_on, toks_on) == (text_off, toks_off), f"request {i} generated different tokens"
        assert lp_on == pytest.approx(lp_off, abs=2e-3), f"request {i} has different logprobs"


def _run(server: RunningServer) -> list[Output]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)
    warm, burst, after = _workload()
    outs = [_complete(client, p, n) for p, n in warm]
    with ThreadPoolExecutor(len(burst)) as pool:
        outs += list(pool.map(lambda pn: _complete(client, *pn), burst))
    outs += [_complete(client, p, n) for p, n in after]
    return outs


@pytest.fixture(scope="module")
def outputs_off(tiny_model: Path) -> list[Output]:
    with RunningServer(_cfg(tiny_model, on=False)) as server:
        return _run(server)


def test_outputs_identical_with_cache_on_under_eviction_and_preemption(
    tiny_model: Path, outputs_off: list[Output]
) -> None:
    # the burst's 64-token outputs outgrow 24 blocks with any two sequences running: preemption happens
    # whatever order the requests arrive in (waiting sequences hold no blocks, so only growth can force it)
    with RunningServer(_cfg(tiny_model, on=True)) as server:
        outputs_on = _run(server)
        stats = server.wait_idle()
        metrics = httpx.get(server.metrics_url + "/metrics", timeout=30).text
    assert stats["kv_blocks_total"] == 24
    assert stats["prefix_cache_hit_tokens"] >= 6 * BLOCK + 2 * BLOCK + 5 * BLOCK  # warm-up hits at least
    assert stats["prefix_cache_evictions"] > 0, stats
    assert stats["preemptions"] > 0, stats
    assert len(outputs_on) == 17
    assert_same_outputs(outputs_on, outputs_off)
    rate = [line for line in metrics.splitlines() if line.startswith("npu_prefix_cache_hit_rate")]
    assert rate and 0.0 < float(rate[0].split()[-1]) < 1.0, rate


def test_chat_multi_turn_reports_cached_tokens(tiny_model: Path) -> None:
    with RunningServer(_cfg(tiny_model, on=True, num_blocks=None)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)
        messages = [{"role": "system", "content": "You are a terse assistant. " * 12},
                    {"role": "user", "content": "Name three colours."}]
        first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
        assert first.usage.prompt_tokens_details is None or not first.usage.prompt_tokens_details.cached_tokens
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And three more?"}]
        second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached >= first.usage.prompt_tokens - BLOCK and cached % BLOCK == 0
        hit_rate = server.host.stats()["npu_prefix_cache_hit_rate"]
        assert 0.0 < hit_rate < 1.0


def _load_error(cfg: dict[str, Any]) -> str:
    with pytest.raises(PluginError) as info:
        load_host(cfg)
    return str(info.value)


def test_plugin_without_enable_prefix_cache_is_refused(tiny_model: Path) -> None:
    cfg = _cfg(tiny_model, on=True)
    cfg["BackendConfig"]["ScheduleConfig"]["enablePrefixCache"] = False
    msg = _load_error(cfg)
    assert "enablePrefixCache" in msg and "prefix_cache" in msg


@pytest.mark.parametrize(("value", "needle"), [(3, "numBlocks is 3; allowed: an integer in [16, "),
                                               ("64", "numBlocks: got '64'; allowed: int in [0, 2147483647]"),
                                               (True, "numBlocks: got True; allowed: int in [0, 2147483647]")])
def test_bad_num_blocks_is_refused(tiny_model: Path, value: Any, needle: str) -> None:
    cfg = _cfg(tiny_model, on=True)
    cfg["Plugins"]["prefix_cache"]["numBlocks"] = value
    msg = _load_error(cfg)
    assert needle in msg, msg


def test_unknown_plugin_key_is_refused(tiny_model: Path) -> None:
    cfg = _cfg(tiny_model, on=True)
    cfg["Plugins"]["prefix_cache"]["blocks"] = 5
    assert "Plugins.prefix_cache.blocks: not a parameter of plugin 'prefix_cache'" in _load_error(cfg)


def test_cli_lists_the_plugin(tmp_path: Path, tiny_model: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_cfg(tiny_model, on=True)))
    out = subprocess.run([sys.executable, "-m", "mindie_host.cli", "plugins", "--config", str(path), "--json"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    rows = {row["name"]: row for row in json.loads(out)}
    assert rows["prefix_cache"]["package"] == "mindie-plugin-prefix-cache"
    assert rows["prefix_cache"]["enabled"] is True
