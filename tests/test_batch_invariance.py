"""Greedy output does not depend on the batch (issue 18, defect 7).

Under the default config (the default model's GGUF, ``quantization: auto``) every matrix product
reads the file's low-bit form at every row count, and on CPU each sequence's attention runs over
exactly its own context, so a token's logits carry the same bits whether its request runs alone
or next to others. Checked on the model (one decode row alone and inside a batch, prefilled
beside others) and through the server: 200 greedy requests at concurrency 32 on the default model
are token-identical to the same requests alone. ``bench/batch_invariance.py`` runs the same check
with longer outputs and times it (bench/PERF.md, "Batch invariance").
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from mindie_host.backends.base import ModelInput
from mindie_host.backends.platform import Platform
from mindie_host.backends.torch.backend import TorchBackend
from mindie_host.models.default import default_model_path
from mindie_host.models.weights import resolve_model
from mindie_host.testing import RunningServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from batch_invariance import PROMPTS, run  # noqa: E402


@pytest.fixture(scope="module")
def default_backend() -> TorchBackend:
    backend = TorchBackend(resolve_model(default_model_path()), name="default", dtype="float32",
                           quantization="auto", platform=Platform())
    backend.load()
    backend.allocate_kv_cache(96, 16)
    return backend


def step(backend: TorchBackend, prompts: list[list[int]], tables: list[list[int]]) -> torch.Tensor:
    """One step that prefills ``prompts`` together (padded to the longest); the last row's logits of each."""
    rows, ends = [], []
    for p in prompts:
        rows.extend(p)
        ends.append(len(rows) - 1)
    return backend.execute(ModelInput(
        input_ids=rows, positions=[t for p in prompts for t in range(len(p))], query_lens=[len(p) for p in prompts],
        context_lens=[len(p) for p in prompts], block_tables=tables, logits_indices=ends,
        row_variants=[-1] * len(prompts)))


def decode(backend: TorchBackend, tokens: list[int], ctx: list[int], tables: list[list[int]]) -> torch.Tensor:
    return backend.execute(ModelInput(
        input_ids=tokens, positions=ctx, query_lens=[1] * len(tokens), context_lens=[c + 1 for c in ctx],
        block_tables=tables, logits_indices=list(range(len(tokens))), row_variants=[-1] * len(tokens)))


@pytest.mark.slow
def test_logits_of_a_sequence_do_not_depend_on_the_batch(default_backend: TorchBackend) -> None:
    lengths = [5, 23, 9, 31, 2, 17, 40, 12, 28, 7, 19, 33, 3, 25, 11, 36, 14, 21, 6, 30]  # 20 > 16 rows
    prompts = [[(37 * s + 11 * t + 1) % 40000 for t in range(n)] for s, n in enumerate(lengths)]
    tables = [[4 * s, 4 * s + 1, 4 * s + 2, 4 * s + 3] for s in range(len(prompts))]
    batched_prefill = step(default_backend, prompts, tables)
    batched_decode = decode(default_backend, [s + 5 for s in range(len(prompts))], lengths, tables)
    for s in (0, 6, 19):
        alone_prefill = step(default_backend, [prompts[s]], [tables[s]])
        alone_decode = decode(default_backend, [s + 5], [lengths[s]], [tables[s]])
        assert torch.equal(alone_prefill[0], batched_prefill[s]), s
        assert torch.equal(alone_decode[0], batched_decode[s]), s


@pytest.mark.slow
def test_greedy_requests_under_load_match_the_same_requests_alone(default_server: RunningServer) -> None:
    result = run(default_server.url, requests=200, concurrency=32, max_tokens=12, prompts=PROMPTS[:12])
    assert result["identical"] == result["requests"], result
