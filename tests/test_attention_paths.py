"""Steps whose sequences bring different numbers of new tokens: padded and ragged attention give the per-sequence result."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mindie_host.backends.base import ModelInput
from mindie_host.backends.platform import Platform
from mindie_host.backends.torch.backend import TorchBackend
from mindie_host.models.weights import resolve_model

BLOCK = 16


@pytest.fixture(scope="module")
def backend(tiny_model: Path) -> TorchBackend:
    b = TorchBackend(resolve_model(tiny_model), name="tiny", dtype="float32", platform=Platform())
    b.load()
    b.allocate_kv_cache(128, BLOCK)
    return b


def _tokens(seq: int, n: int) -> list[int]:
    return [(31 * seq + 7 * t + 3) % 1000 + 10 for t in range(n)]


def _prefill(backend: TorchBackend, ids: list[int], table: list[int]) -> torch.Tensor:
    n = len(ids)
    return backend.execute(ModelInput(input_ids=ids, positions=list(range(n)), query_lens=[n], context_lens=[n],
                                      block_tables=[table], logits_indices=[n - 1], row_variants=[-1]))


@pytest.mark.parametrize(
    ("cached", "new"),
    [
        ([10, 20, 3, 17], [5, 7, 6, 8]),  # a wave of short prompts after prefix hits: padded into one batch
        ([30, 12, 25, 0], [1, 1, 1, 40]),  # decodes next to a long prefill chunk: ragged
    ],
)
def test_mixed_query_lengths_match_each_sequence_alone(backend: TorchBackend, cached: list[int], new: list[int]) -> None:
    tables = [list(range(i * 4, (i + 1) * 4)) for i in range(len(cached))]
    alone_tables = [list(range(64 + i * 4, 64 + (i + 1) * 4)) for i in range(len(cached))]
    want = []
    for i, (c, n) in enumerate(zip(cached, new)):
        full = _tokens(i, c + n)
        want.append(_prefill(backend, full, alone_tables[i])[0])  # the whole sequence in one go, alone
        if c:
            _prefill(backend, full[:c], tables[i])  # its cached part, as an earlier step left it
    ids, pos, rows = [], [], []
    for i, (c, n) in enumerate(zip(cached, new)):
        ids += _tokens(i, c + n)[c:]
        pos += list(range(c, c + n))
        rows.append(len(ids) - 1)
    got = backend.execute(ModelInput(
        input_ids=ids, positions=pos, query_lens=new, context_lens=[c + n for c, n in zip(cached, new)],
        block_tables=tables, logits_indices=rows, row_variants=[-1] * len(new),
    ))
    for i in range(len(new)):
        torch.testing.assert_close(got[i], want[i], rtol=1e-4, atol=1e-4)
