"""Everything else still works with the plugin's families: tensor parallelism with the paged-KV features and swap,
int8 KV and the int8 weight schemes (the engine process, structured outputs and multi_lora: test_qwen3_serving.py).

One lean run of each feature per family, against the plain engine's greedy tokens (or fp32 logits) on the same
tiny model. Qwen2 and Mistral are the builtin Llama family, which the suite covers; ``gemma3`` is ``gemma3_text``'s
layers behind a multimodal checkpoint (test_match_transformers.py serves it).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from family_cases import DENSE_FAMILIES, PLUGIN_FAMILIES

from mindie_host.api import EngineRequest, ModelInput, SamplingParams
from mindie_host.testing import loaded_host, run_engine, server_config

BOTH_PLUGINS = {"plugin_params": json.dumps({"plugin_type": "prefix_cache,splitfuse"})}
SPLIT = {
    "templateType": "Mix",
    "enableSplit": True,
    "enablePrefixCache": True,
    "splitChunkTokens": 16,
    "splitStartBatchSize": 0,
}
NEW = 32


def prompts() -> list[list[int]]:
    """Five prompts sharing a 40-token prefix (the prefix cache serves it from the second on), past the windows."""
    shared = list(range(300, 340))
    return [shared + [(11 * i + 7 * j) % 30000 + 500 for j in range(3 + 5 * i)] for i in range(5)]


def _config(path: Path, world: int = 1, **extra: Any) -> dict[str, Any]:
    model = {"worldSize": world, "dtype": "float32", "quantization": "none", **extra.pop("model", {})}
    cfg = server_config(path, model=model, **extra)
    cfg["BackendConfig"]["npuDeviceIds"] = [list(range(world))]
    return cfg


def _greedy(cfg: dict[str, Any], batch: list[list[int]]) -> tuple[list[list[int]], dict[str, float]]:
    """The greedy tokens of ``batch`` (all in one engine) and the engine's stats."""
    host = loaded_host(cfg)
    try:
        reqs = [EngineRequest(f"r{i}", p, SamplingParams(max_tokens=NEW, ignore_eos=True)) for i, p in enumerate(batch)]
        out = run_engine(host, reqs)
        stats = host.stats()
    finally:
        host.shutdown()
    return [out[f"r{i}"].token_ids for i in range(len(batch))], stats


@pytest.fixture(scope="module")
def plain(tiny_family: Callable[[str], Path]) -> Callable[[str], list[list[int]]]:
    """``plain(name)``: the plain engine's greedy tokens of :func:`prompts` on family ``name`` (one rank)."""
    done: dict[str, list[list[int]]] = {}

    def get(name: str) -> list[list[int]]:
        if name not in done:
            done[name] = _greedy(_config(tiny_family(name)), prompts())[0]
        return done[name]

    return get


# glm4's layers are glm's with two more norms (the same fused gate/up and attention slices): glm4 stands for both
@pytest.mark.parametrize("name", [name for name in PLUGIN_FAMILIES if name != "glm"])
def test_two_ranks_with_prefix_cache_splitfuse_and_swap_equal_one(
    name: str, tiny_family: Callable[[str], Path], plain: Callable[[str], list[list[int]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two tensor-parallel ranks with prefix_cache and splitfuse, on a pool small enough that sequences are swapped
    out and back (MIES_USE_MB_SWAPPER=1 turns swap on): one plain rank's greedy tokens."""
    monkeypatch.setenv("MIES_USE_MB_SWAPPER", "1")
    cfg = _config(
        tiny_family(name),
        2,
        model={**BOTH_PLUGINS, "maxKvBlocks": 9, "cpuMemSize": 1},
        schedule={**SPLIT, "maxPreemptCount": 4, "maxBatchSize": 8, "maxPrefillBatchSize": 8, "maxIterTimes": 100},
        deploy={"maxSeqLen": 128, "maxInputTokenLen": 96},
    )
    got, stats = _greedy(cfg, prompts())
    assert got == plain(name)
    assert stats.get("swapped_out", 0) > 0, {k: v for k, v in stats.items() if "swap" in k or "preempt" in k}


def _logits(backend: Any, prompt: list[int]) -> torch.Tensor:
    """Teacher-forced logits at every prompt position, then a decode step reading the cache back."""
    n = len(prompt)
    table = list(range(1, -(-(n + 1) // 16) + 1))
    prefill = ModelInput(
        input_ids=prompt,
        positions=list(range(n)),
        query_lens=[n],
        context_lens=[n],
        block_tables=[table],
        logits_indices=list(range(n)),
        row_variants=[-1],
    )
    decode = ModelInput(
        input_ids=[7],
        positions=[n],
        query_lens=[1],
        context_lens=[n + 1],
        block_tables=[table],
        logits_indices=[0],
        row_variants=[-1],
    )
    return torch.cat([backend.execute(prefill), backend.execute(decode)])


@pytest.mark.parametrize("name", DENSE_FAMILIES)
def test_int8_kv_cache_and_weight_schemes(name: str, tiny_family: Callable[[str], Path]) -> None:
    """w8a16, and w8a8 with an int8 KV cache, against fp32: every decoder product runs in int8, the logits stay
    within a few percent of the largest (the Llama path's bounds) and the top token mostly agrees (tiny random
    models have near-ties, so the agreement bound is looser than the Llama test's)."""
    path = tiny_family(name)
    prompt = prompts()[-1]

    @contextmanager
    def backend(**model: Any) -> Iterator[Any]:
        """A host's backend for these settings; the host is shut down (its pool freed) before the next is made."""
        host = loaded_host(server_config(path, model={"device": "cpu", "dtype": "float32", **model}))
        try:
            yield host.backend
        finally:
            host.shutdown()

    with backend(quantization="none") as plain_fp32:
        want = _logits(plain_fp32, prompt)
    for settings, kind, max_err in (
        ({"quantization": "w8a16"}, "W8A16Weight", 0.03),
        ({"quantization": "w8a8", "kvCacheDtype": "int8"}, "W8A8DynamicWeight", 0.05),
    ):
        with backend(**settings) as quantized:
            layer = quantized.model.layers[-1]
            products = (layer.attn.qkv, layer.attn.o_proj, layer.mlp.gate_up, layer.mlp.down)
            assert all(type(w).__name__ == kind for w in products), [type(w).__name__ for w in products]
            got = _logits(quantized, prompt)
        agree = float((got.argmax(-1) == want.argmax(-1)).float().mean())
        err = float((got - want).abs().max() / want.abs().max())
        assert agree >= 0.85 and err <= max_err, (settings, agree, err)
        assert not torch.equal(got, want)
