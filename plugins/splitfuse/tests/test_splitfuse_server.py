"""splitfuse on a real server: greedy outputs identical to the Standard template, alone and with prefix_cache."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from mindie_host import hookimpl
from mindie_host.api import PluginError
from mindie_host.testing import RunningServer, load_host, make_tiny_llama, server_config

CHUNK = 32
Output = tuple[str, list[str], list[float]]


class PlanRecorder:
    """Wraps ``mindie_host_plan_step`` to record every planned step (sequence id, tokens, tokens left)."""

    def __init__(self) -> None:
        self.steps: list[list[tuple[int, int, int]]] = []

    @hookimpl(wrapper=True)
    def mindie_host_plan_step(self, ctx: Any, state: Any) -> Any:
        plan = yield
        if plan:
            self.steps.append([(s.seq_id, n, s.num_uncomputed) for s, n in plan.scheduled])
        return plan

    def max_tokens(self) -> int:
        return max(sum(n for _, n, _ in step) for step in self.steps)

    def mixed_steps(self) -> int:
        """Steps holding a decode and a prompt chunk that does not finish its prompt."""
        return sum(1 for step in self.steps if any(left == 1 for _, _, left in step)
                   and any(1 < n < left for _, n, left in step))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama in HF format with the SmolLM2 tokenizer (defined here, not in a conftest.py,
    so this directory adds no second ``conftest`` module to the test session)."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-splitfuse"))


def _cfg(model: Path, plugins: str, **schedule: Any) -> dict[str, Any]:
    sched: dict[str, Any] = {"cacheBlockSize": 16, "maxBatchSize": 8, "maxPrefillBatchSize": 8, "maxIterTimes": 256}
    if "splitfuse" in plugins:
        sched.update({"templateType": "Mix", "enableSplit": True, "splitChunkTokens": CHUNK,
                      "splitStartBatchSize": 0})
    if "prefix_cache" in plugins:
        sched["enablePrefixCache"] = True
    sched.update(schedule)
    model_cfg = {"plugin_params": json.dumps({"plugin_type": plugins})} if plugins else {}
    # engineProcess false: PlanRecorder reads the engine's plans, so the engine must run in this process
    return server_config(model, model=model_cfg, schedule=sched, deploy={"maxSeqLen": 512, "maxInputTokenLen": 400},
                         server={"engineProcess": False})


def _complete(client: openai.OpenAI, prompt: list[int], max_tokens: int, delay: float) -> Output:
    time.sleep(delay)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                  logprobs=1, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == max_tokens
    c = r.choices[0]
    return c.text, list(c.logprobs.tokens), list(c.logprobs.token_logprobs)


def _run(server: RunningServer) -> list[Output]:
    """Short prompts decoding for a while; long prompts (some sharing a prefix) arriving meanwhile."""
    rng = random.Random(11)

    def toks(n: int) -> list[int]:
        return [rng.randrange(1000, 20000) for _ in range(n)]

    shared = toks(120)
    jobs = [(toks(20), 200, 0.0) for _ in range(4)]  # still decoding when the long prompts arrive (0.3-1.1 s)
    jobs += [(toks(rng.randrange(150, 300)), 12, 0.3 + 0.2 * i) for i in range(3)]
    jobs += [(shared + toks(30 + 10 * i), 12, 0.5 + 0.3 * i) for i in range(3)]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)
    with ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda j: _complete(client, *j), jobs))
    outs.append(_complete(client, shared + toks(5), 12, 0.0))  # after everything: prefix still cached
    return outs


def assert_same_outputs(got: list[Output], want: list[Output]) -> None:
    """Same tokens, and logprobs equal up to float noise."""
    assert len(got) == len(want)
    for i, ((text_a, toks_a, lp_a), (text_b, toks_b, lp_b)) in enumerate(zip(got, want)):
        assert (text_a, toks_a) == (text_b, toks_b), f"request {i} generated different tokens"
        assert lp_a == pytest.approx(lp_b, abs=2e-3), f"request {i} has different logprobs"


@pytest.fixture(scope="module")
def outputs_standard(tiny_model: Path) -> list[Output]:
    with RunningServer(_cfg(tiny_model, "")) as server:
        return _run(server)


@pytest.mark.parametrize("plugins", ["splitfuse", "prefix_cache,splitfuse"])
def test_outputs_identical_to_standard(tiny_model: Path, outputs_standard: list[Output], plugins: str) -> None:
    recorder = PlanRecorder()
    with RunningServer(_cfg(tiny_model, plugins), plugins=[(recorder, "plan-recorder")]) as server:
        outputs = _run(server)
        stats = server.wait_idle()
    assert_same_outputs(outputs, outputs_standard)
    assert recorder.max_tokens() <= CHUNK
    assert recorder.mixed_steps() > 0, "no step mixed decodes with a prompt chunk"
    if "prefix_cache" in plugins:
        assert stats["prefix_cache_hit_tokens"] >= 7 * 16  # at least the last request reuses the 7-block prefix


def test_mix_without_split_mixes_whole_prompts(tiny_model: Path, outputs_standard: list[Output]) -> None:
    recorder = PlanRecorder()
    cfg = _cfg(tiny_model, "splitfuse", enableSplit=False)
    with RunningServer(cfg, plugins=[(recorder, "plan-recorder")]) as server:
        outputs = _run(server)
    assert_same_outputs(outputs, outputs_standard)
    assert recorder.max_tokens() > CHUNK
    assert all(n == left for step in recorder.steps for _, n, left in step), "a prompt was split"
    assert any(len({left == 1 for _, _, left in step}) == 2 for step in recorder.steps), "no mixed step"


def _load_error(cfg: dict[str, Any]) -> str:
    with pytest.raises(PluginError) as info:
        load_host(cfg)
    return str(info.value)


def test_standard_template_with_plugin_is_refused(tiny_model: Path) -> None:
    msg = _load_error(_cfg(tiny_model, "splitfuse", templateType="Standard"))
    assert "templateType is 'Standard'" in msg and '"Mix"' in msg


def test_cli_lists_the_plugin(tmp_path: Path, tiny_model: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_cfg(tiny_model, "splitfuse")))
    out = subprocess.run([sys.executable, "-m", "mindie_host.cli", "plugins", "--config", str(path)],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    line = next(row for row in out.splitlines() if row.startswith("splitfuse"))
    assert "mindie-plugin-splitfuse" in line and line.split()[-1] == "yes"
