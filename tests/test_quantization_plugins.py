"""The plugins on a w8a8 checkpoint: prefix_cache and splitfuse give the same greedy outputs as plain
w8a8 serving, and multi_lora applies its adapters on top of the int8 base."""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from mindie_host.backends.int8 import W8A8DynamicWeight
from mindie_host.cli import main as cli_main
from mindie_host.testing import RunningServer, make_tiny_llama, server_config

CHUNK = 32
Output = tuple[list[str], list[float]]


@pytest.fixture(scope="module")
def w8a8_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-w8a8-base"), seed=3)
    out = tmp_path_factory.mktemp("tiny-llama-w8a8") / "model"
    assert cli_main(["quantize", "--model", str(base), "--scheme", "w8a8", "--out", str(out)]) == 0
    return out


def _cfg(model: Path, plugins: str) -> dict[str, Any]:
    sched: dict[str, Any] = {"cacheBlockSize": 16, "maxBatchSize": 8, "maxPrefillBatchSize": 8, "maxIterTimes": 128}
    if "splitfuse" in plugins:
        sched.update({"templateType": "Mix", "enableSplit": True, "splitChunkTokens": CHUNK, "splitStartBatchSize": 0})
    if "prefix_cache" in plugins:
        sched["enablePrefixCache"] = True
    model_cfg: dict[str, Any] = {"quantization": "w8a8"}
    if plugins:
        model_cfg["plugin_params"] = json.dumps({"plugin_type": plugins})
    return server_config(model, model=model_cfg, schedule=sched, deploy={"maxSeqLen": 512, "maxInputTokenLen": 400},
                         server={"engineProcess": False})  # _run checks the backend's layer type in this process


def _complete(client: openai.OpenAI, prompt: list[int], max_tokens: int, delay: float) -> Output:
    time.sleep(delay)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=1,
                                  extra_body={"ignore_eos": True})
    c = r.choices[0]
    return list(c.logprobs.tokens), list(c.logprobs.token_logprobs)


def _run(server: RunningServer) -> list[Output]:
    """Short prompts decoding while long ones (two sharing a prefix) arrive, then the prefix again."""
    assert isinstance(server.host.backend.model.layers[0].attn.qkv, W8A8DynamicWeight)
    rng = random.Random(5)

    def toks(n: int) -> list[int]:
        return [rng.randrange(1000, 20000) for _ in range(n)]

    shared = toks(80)
    jobs = [(toks(12), 60, 0.0) for _ in range(2)]
    jobs += [(toks(120), 8, 0.2), (shared + toks(20), 8, 0.3), (shared + toks(30), 8, 0.6)]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)
    with ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda j: _complete(client, *j), jobs))
    outs.append(_complete(client, shared + toks(5), 8, 0.0))  # after the others: the prefix is cached
    return outs


@pytest.fixture(scope="module")
def plain_outputs(w8a8_model: Path) -> list[Output]:
    with RunningServer(_cfg(w8a8_model, "")) as server:
        return _run(server)


@pytest.mark.parametrize("plugins", ["prefix_cache", "splitfuse"])
def test_w8a8_plugins_match_plain_w8a8(w8a8_model: Path, plain_outputs: list[Output], plugins: str) -> None:
    with RunningServer(_cfg(w8a8_model, plugins)) as server:
        outputs = _run(server)
        stats = server.wait_idle()
    for i, ((toks_a, lp_a), (toks_b, lp_b)) in enumerate(zip(outputs, plain_outputs)):
        assert toks_a == toks_b, f"request {i} generated different tokens with {plugins}"
        assert lp_a == pytest.approx(lp_b, abs=2e-3)
    if plugins == "prefix_cache":
        assert stats["prefix_cache_hit_tokens"] >= 5 * 16


def test_multi_lora_on_w8a8(w8a8_model: Path, tmp_path: Path) -> None:
    """Adapters run in floating point beside the int8 base (w8a8 at load, or an unsmoothed checkpoint):
    an adapter changes the output, and its first tokens are the fp32 base's with the same adapter.
    A smoothed checkpoint, whose layers were rescaled per channel, refuses adapters at startup."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    base = make_tiny_llama(tmp_path / "fp32", seed=3)  # the same weights w8a8_model was made from
    torch.manual_seed(1)
    model = get_peft_model(LlamaForCausalLM(LlamaConfig.from_pretrained(str(base))),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                      lora_dropout=0.0, task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.6)
    model.save_pretrained(str(tmp_path / "adapter"))
    prompts = [[1, 504, 3458, 314, 253, 1234], [1, 9, 10, 11, 12, 13, 14]]

    def config(path: Path, quant: str) -> dict[str, Any]:
        (path / "lora_adapter.json").write_text(json.dumps({"ad": str(tmp_path / "adapter")}))
        return server_config(path, model={"quantization": quant,
                                          "plugin_params": json.dumps({"plugin_type": "multi_lora"})})

    def generate(path: Path, quant: str) -> dict[str | None, list[list[str]]]:
        out: dict[str | None, list[list[str]]] = {}
        with RunningServer(config(path, quant)) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
            for name in (None, "ad"):
                out[name] = []
                for p in prompts:
                    r = client.completions.create(model=name or "tiny", prompt=p, max_tokens=4, temperature=0,
                                                  logprobs=1, extra_body={"ignore_eos": True})
                    out[name].append(list(r.choices[0].logprobs.tokens))
        return out

    fp32 = generate(base, "none")
    unsmoothed = tmp_path / "w8a8-unsmoothed"
    assert cli_main(["quantize", "--model", str(base), "--scheme", "w8a8", "--no-smooth", "--out", str(unsmoothed)]) == 0
    for path in (base, unsmoothed):  # w8a8 at load; an unsmoothed w8a8 checkpoint
        int8 = generate(path, "w8a8")
        assert int8["ad"] != int8[None]
        assert [t[0] for t in int8["ad"]] == [t[0] for t in fp32["ad"]]
        assert [t[0] for t in int8[None]] == [t[0] for t in fp32[None]]
    with pytest.raises(RuntimeError) as err:
        RunningServer(config(w8a8_model, "auto")).start()
    assert "smoothed" in str(err.value) and "--no-smooth" in str(err.value)
