"""``kvCacheDtype``: the KV cache in another precision than the weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mindie_host.api import EngineRequest, SamplingParams
from mindie_host.backends.base import ModelInput
from mindie_host.config import ConfigError, config_from_dict
from mindie_host.testing import loaded_host, run_engine, server_config


def _host(tiny_model: Path, kv: str) -> object:
    return loaded_host(server_config(tiny_model, model={"device": "cpu", "dtype": "float32", "kvCacheDtype": kv}))


def test_bfloat16_cache_halves_the_bytes_and_keeps_the_logits(tiny_model: Path) -> None:
    full = _host(tiny_model, "auto").backend
    half = _host(tiny_model, "bfloat16").backend
    assert full.kv_caches[0][0].dtype == torch.float32
    assert half.kv_caches[0][0].dtype == torch.bfloat16 and half.model.dtype == torch.float32
    assert 2 * half.kv_cache_bytes_per_block(16) == full.kv_cache_bytes_per_block(16)
    prompt = list(range(300, 340))
    prefill = ModelInput(input_ids=prompt, positions=list(range(40)), query_lens=[40], context_lens=[40],
                         block_tables=[[1, 2, 3]], logits_indices=[39], row_variants=[-1])
    decode = ModelInput(input_ids=[7], positions=[40], query_lens=[1], context_lens=[41], block_tables=[[1, 2, 3]],
                        logits_indices=[0], row_variants=[-1])
    for step in (prefill, decode):  # the decode step reads the prompt's K/V back from the cache
        want, got = full.execute(step), half.execute(step)
        scale = want.abs().max().item()
        assert torch.allclose(got, want, rtol=0.02, atol=0.02 * scale)
        assert not torch.equal(got, want)  # the cache really is stored at lower precision
    # whole requests run through the engine, batched, with the lower-precision cache
    host = _host(tiny_model, "bfloat16")
    reqs = [EngineRequest(f"r{i}", [5 + i] * (3 + i), SamplingParams(max_tokens=10, ignore_eos=True)) for i in range(4)]
    outs = run_engine(host, reqs)
    assert all(len(o.token_ids) == 10 for o in outs.values())


def test_kv_cache_dtype_is_validated_by_name() -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict(server_config(None, model={"kvCacheDtype": "int4"}))
    assert "kvCacheDtype" in str(err.value) and "bfloat16" in str(err.value)
