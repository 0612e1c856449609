"""The example family against transformers' ``GraniteForCausalLM`` on a tiny random model with all four scalars
set: the plugin is enabled by the checkpoint's model_type alone, and greedy tokens and prompt logprobs match."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mindie_host.api import EngineRequest, SamplingParams
from mindie_host.testing import loaded_host, make_tiny_model, run_engine, server_config


@pytest.fixture(scope="module")
def tiny_granite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import GraniteConfig, GraniteForCausalLM

    return make_tiny_model(
        tmp_path_factory.mktemp("granite"),
        GraniteConfig,
        GraniteForCausalLM,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        embedding_multiplier=3.0,
        attention_multiplier=0.2,
        residual_multiplier=0.5,
        logits_scaling=2.0,
    )


def test_granite_equals_transformers(tiny_granite: Path) -> None:
    from transformers import GraniteForCausalLM

    prompts = [[(13 * i + 29 * n) % 40000 + 100 for i in range(n)] for n in (9, 21)]
    host = loaded_host(server_config(tiny_granite, model={"dtype": "float32", "quantization": "none"}))
    try:
        assert host.plugins.pm.has_plugin("granite")  # enabled by the checkpoint's model_type, not by config
        assert host.backend.family.name == "granite"
        reqs = [
            EngineRequest(f"r{i}", p, SamplingParams(max_tokens=16, ignore_eos=True, prompt_logprobs=0))
            for i, p in enumerate(prompts)
        ]
        out = run_engine(host, reqs)
    finally:
        host.shutdown()
    model = GraniteForCausalLM.from_pretrained(str(tiny_granite), dtype=torch.float32).eval()
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            ids = torch.tensor([prompt])
            want = model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
            assert out[f"r{i}"].token_ids == want[0, len(prompt) :].tolist()
            logp = torch.log_softmax(model(ids).logits[0], -1)
            want_lps = [float(logp[j, prompt[j + 1]]) for j in range(len(prompt) - 1)]
            got_lps = [lp.logprob for lp in out[f"r{i}"].prompt_logprobs[1:]]
            assert got_lps == pytest.approx(want_lps, abs=1e-4)
