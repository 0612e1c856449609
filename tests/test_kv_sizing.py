"""Sizing the CPU KV pool (issue 15, point 14): from what the scheduler can use, within the memory
budget, committed only as used, and explained in one startup log line."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest

from mindie_host.backends.lazy_memory import resident_bytes
from mindie_host.testing import loaded_host, make_tiny_llama, server_config

MIB = 1 << 20


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("kv-model"), max_position_embeddings=8192)


def test_default_budget_gives_the_computed_pool_and_says_why(long_model: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    # the default cpuMemSize (5 GB) is far more than 8 sequences of 1024 tokens of this model need
    cfg = server_config(long_model, model={"cpuMemSize": 5}, schedule={"maxBatchSize": 8, "cacheBlockSize": 16, "maxPrefillBatchSize": 8})
    with caplog.at_level(logging.INFO, logger="mindie_host"):
        host = loaded_host(cfg)
    try:
        wanted = 8 * math.ceil(1024 / 16) + 1
        assert host.llm is not None and host.llm.kv.num_blocks == wanted
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache on cpu")]
        assert len(lines) == 1
        assert f"{wanted} blocks x 16 tokens" in lines[0]
        assert "limited by maxBatchSize=8 x ceil(maxSeqLen=1024 / 16) + 1" in lines[0]
    finally:
        host.shutdown()


def test_budget_caps_the_pool_and_is_named(long_model: Path, caplog: pytest.LogCaptureFixture) -> None:
    # 4096 sequences of 8192 tokens would need 16 GiB of this model's cache: cpuMemSize 1 GB decides
    cfg = server_config(long_model, model={"cpuMemSize": 1}, deploy={"maxSeqLen": 8192, "maxInputTokenLen": 4096},
                        schedule={"maxBatchSize": 4096, "cacheBlockSize": 16, "maxPrefillBatchSize": 16})
    with caplog.at_level(logging.INFO, logger="mindie_host"):
        host = loaded_host(cfg)
    try:
        assert host.backend is not None and host.llm is not None
        per_block = host.backend.kv_cache_bytes_per_block(16)
        assert host.llm.kv.num_blocks == (1 << 30) // per_block
        line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache on cpu"))
        assert "limited by cpuMemSize=1 GB" in line and "committed as blocks are used" in line
    finally:
        host.shutdown()


def test_unused_pool_is_not_resident(long_model: Path) -> None:
    # a 1 GiB pool: resident memory grows by what warm-up writes, not by the pool
    cfg = server_config(long_model, model={"cpuMemSize": 1}, deploy={"maxSeqLen": 8192, "maxInputTokenLen": 4096},
                        schedule={"maxBatchSize": 4096, "cacheBlockSize": 16, "maxPrefillBatchSize": 16})
    before = resident_bytes()
    host = loaded_host(cfg)
    try:
        assert host.llm is not None and host.backend is not None
        pool = host.llm.kv.num_blocks * host.backend.kv_cache_bytes_per_block(16)
        assert pool >= 900 * MIB
        grown = resident_bytes() - before
        assert grown < 250 * MIB, f"loading grew RSS by {grown / MIB:.0f} MiB for a {pool / MIB:.0f} MiB pool"
        # the cache still reads back as zeros where nothing was written, and takes writes
        k, _ = host.backend.kv_caches[0]  # type: ignore[attr-defined]
        assert float(k[-1000:].abs().sum()) == 0.0
        k[-1] = 1.0
        assert float(k[-1].sum()) == k[-1].numel()
    finally:
        host.shutdown()
