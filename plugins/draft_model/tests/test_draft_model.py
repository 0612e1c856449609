"""The ``draft_model`` plugin: a second model in the engine proposes, greedy output stays the served model's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mindie_host.api import EngineRequest, PluginError, SamplingParams
from mindie_host.testing import loaded_host, run_engine, server_config

PROMPTS = ["The quick brown fox", "def f(x):\n    return", "1 2 3 4 5", "Hello there, how are"]


def config(tiny_model: Path, draft: Path, **params: Any) -> dict[str, Any]:
    return server_config(tiny_model, model={"plugin_params": json.dumps({"plugin_type": "draft_model"})},
                         plugins={"draft_model": {"modelWeightPath": str(draft), "quantization": "none", **params}})


def reqs(host: Any, **sampling: Any) -> list[EngineRequest]:
    params = {"max_tokens": 16, "ignore_eos": True, **sampling}
    return [EngineRequest(f"d{i}", host.tokenizer.encode(p), SamplingParams(**params)) for i, p in enumerate(PROMPTS)]


def test_greedy_output_is_the_served_models_and_the_draft_kv_is_rolled_back(tiny_model: Path) -> None:
    off = loaded_host(server_config(tiny_model))
    want = {k: v.token_ids for k, v in run_engine(off, reqs(off)).items()}
    # the served model as its own draft: every greedy draft is right
    on = loaded_host(config(tiny_model, tiny_model, numSpeculativeTokens=3))
    got = run_engine(on, reqs(on))
    assert {k: v.token_ids for k, v in got.items()} == want
    stats = on.llm.stats()
    assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"] > 0
    drafter = on.plugins.state("draft_model").drafter
    assert drafter.seqs == {} and drafter.kv.num_used_blocks() == 0  # released with the requests
    # sampled requests: drafts are often rejected, the draft KV rolls back, every request completes
    sampled = run_engine(on, reqs(on, do_sample=True, temperature=1.5, seed=3))
    assert all(len(o.token_ids) == 16 for o in sampled.values())
    stats = on.llm.stats()
    assert stats["spec_draft_tokens"] > stats["spec_accepted_tokens"]
    assert drafter.kv.num_used_blocks() == 0


def test_a_bad_scheme_is_refused_at_startup(tiny_model: Path) -> None:
    with pytest.raises(PluginError, match="quantization"):
        loaded_host(config(tiny_model, tiny_model, quantization="q3"))
