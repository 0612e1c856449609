"""multi_lora under tensor parallelism (worldSize 2): adapters shard the way the layers they modify do.

Each rank applies its slice of every adapter's delta (column-parallel q/k/v and gate/up keep
their output columns; o and down add a partial delta before the all-reduce). Greedy output with
three adapters and the base model in one batch, and with an adapter loaded at run time (its
weights reach rank 1 through the runtime's ``version``), equals HF transformers with the
adapter merged. With ``llma`` proposing drafts in the engine process (rank 0), whose verification rows reach
rank 1 in the step's batch: output with drafts equals output without (a request opted out) and the drafts are
accepted.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from mindie_host.testing import RunningServer, rank_pids
from multi_lora_helpers import PROMPTS, lora_config
from transformers import AutoTokenizer

MAX_NEW = 12


def _complete(server: RunningServer, model: str, prompt_index: int) -> str:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    out = client.completions.create(model=model, prompt=PROMPTS[prompt_index], max_tokens=MAX_NEW, temperature=0)
    return out.choices[0].text


@pytest.mark.slow  # two ranks in spawned processes
def test_adapters_under_tp2_match_hf_merged(lora_base: Path, lora_adapters: dict[str, Path],
                                            hf_reference: Callable) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(lora_base))
    cfg = lora_config(lora_base, maxLoras=4, maxLoraRank=16, runtimeAdapterDir=str(lora_adapters["delta"].parent))
    cfg["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0].update(
        {"worldSize": 2, "dtype": "float32", "plugin_params": json.dumps({"plugin_type": "multi_lora,llma"})})
    cfg["Plugins"]["llma"] = {"numSpeculativeTokens": 4, "minNgram": 1, "maxBatchSize": 16}
    cfg["BackendConfig"]["npuDeviceIds"] = [[0, 1]]
    with RunningServer(cfg, timeout=180) as server:
        if server.host.backend is not None:  # ServerConfig.engineProcess false: rank 0 in this process
            assert server.host.backend.world_size == 2
        else:  # rank 0 is the engine process; rank 1 its child
            assert len(rank_pids(server.host.engine.process.pid)) == 1
        jobs = [(m, i) for i in range(len(PROMPTS)) for m in ("alpha", "beta", "gamma", "tiny")]
        with ThreadPoolExecutor(len(jobs)) as pool:
            results = list(pool.map(lambda job: _complete(server, *job), jobs))
        for (model, i), got in zip(jobs, results):
            adapter = None if model == "tiny" else model
            want = tokenizer.decode(hf_reference(adapter, i, MAX_NEW), skip_special_tokens=True)
            assert got == want, (model, i)
        r = httpx.post(server.management_url + "/v1/load_lora_adapter",
                       json={"lora_name": "delta", "lora_path": str(lora_adapters["delta"])})
        assert r.status_code == 200, r.text
        want = tokenizer.decode(hf_reference("delta", 1, MAX_NEW), skip_special_tokens=True)
        assert _complete(server, "delta", 1) == want
        # a prompt whose output falls into a loop llma copies, with and without drafts
        texts = []
        for speculate in (False, True):
            body = {"model": "tiny", "prompt": [5, 6, 7, 8] * 10, "max_tokens": 24, "temperature": 0,
                    "ignore_eos": True, "speculative_decoding": speculate}
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        assert texts[0] == texts[1]
        stats = server.wait_idle()
        assert stats["spec_accepted_tokens"] > 0 and stats["spec_draft_tokens"] >= stats["spec_accepted_tokens"]
