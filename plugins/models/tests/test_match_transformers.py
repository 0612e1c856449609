"""Each family against transformers' own implementation, on the tiny random model of its config class.

Served through the host (the family's plugin enabled by itself from the checkpoint's model_type), in float32: the
greedy tokens of four prompts, 32 each, equal ``generate``'s, and the logprob of every prompt token is within 1e-4
of transformers' forward pass.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from family_cases import SPECS, one_thread, prompts

from mindie_host.api import EngineRequest, SamplingParams
from mindie_host.testing import loaded_host, run_engine, server_config

NEW_TOKENS = 32


def served(path: Path, batch: list[list[int]]) -> tuple[list[list[int]], list[list[float]], str]:
    """The host's greedy tokens and prompt logprobs (all prompts in one engine, as a server batches them)."""
    host = loaded_host(server_config(path, model={"dtype": "float32", "quantization": "none"}))
    try:
        family = host.backend.family.name
        reqs = [
            EngineRequest(f"r{i}", p, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=0))
            for i, p in enumerate(batch)
        ]
        out = run_engine(host, reqs)
    finally:
        host.shutdown()
    tokens = [out[f"r{i}"].token_ids for i in range(len(batch))]
    lps = [[lp.logprob for lp in out[f"r{i}"].prompt_logprobs[1:]] for i in range(len(batch))]
    return tokens, lps, family


def reference(path: Path, model_class: Any, batch: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    """transformers' greedy tokens (one prompt at a time) and prompt logprobs."""
    model = model_class.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()
    tokens, lps = [], []
    with torch.no_grad(), one_thread():
        for prompt in batch:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
            )
            tokens.append(out[0, len(prompt) :].tolist())
            logp = torch.log_softmax(model(ids).logits[0].float(), -1)
            lps.append([float(logp[i, prompt[i + 1]]) for i in range(len(prompt) - 1)])
    return tokens, lps


@pytest.mark.parametrize("name", list(SPECS))
def test_family_equals_transformers(name: str, tiny_family: Callable[[str], Path]) -> None:
    path = tiny_family(name)
    _, model_class = SPECS[name].classes()
    config = model_class.config_class.from_pretrained(str(path))
    batch = prompts(config.get_text_config().vocab_size)
    tokens, lps, family = served(path, batch)
    assert family == {"qwen2": "llama", "mistral": "llama", "gemma3_text": "gemma3"}.get(name, name)
    want_tokens, want_lps = reference(path, model_class, batch)
    assert tokens == want_tokens
    for got, want in zip(lps, want_lps):
        assert got == pytest.approx(want, abs=1e-4)
