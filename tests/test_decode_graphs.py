"""Bucketed decode steps (CUDA graphs on GPUs): padding a step to its bucket changes no token.

On the CPU the bucketed step runs eagerly, padded exactly as it is when captured, so
these tests check the padding (scratch slot, padded rows, context buckets) without a
GPU. ``tests/test_cuda.py`` checks the captured graphs on a GPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mindie_host import hookimpl
from mindie_host.api import EngineRequest, SamplingParams
from mindie_host.backends.platform import select_platform
from mindie_host.backends.torch.backend import TorchBackend
from mindie_host.backends.torch.graphs import BATCH_BUCKETS, batch_bucket, context_bucket
from mindie_host.models.weights import resolve_model
from mindie_host.testing import loaded_host, run_engine, server_config


class BucketedBackend:
    """Serves ``backendType: torch`` with the bucketed decode path forced on."""

    def __init__(self, device: str = "cpu", dtype: str = "float32") -> None:
        self.device = device
        self.dtype = dtype

    @hookimpl
    def mindie_host_model_backend(self, ctx: Any, backend_type: str) -> TorchBackend | None:
        model_config = ctx.model
        return TorchBackend(
            resolve_model(model_config.modelWeightPath), name=model_config.modelName, dtype=self.dtype,
            decode_graphs=True, platform=select_platform(self.device),
        )


def requests() -> list[EngineRequest]:
    """Mixed lengths: three short prompts (a batch of 3 pads to 4) and one whose context crosses 128."""
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [42] * 11, list(range(200, 320))]
    return [EngineRequest(f"r{i}", p, SamplingParams(max_tokens=16, ignore_eos=True)) for i, p in enumerate(prompts)]


def test_buckets() -> None:
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 17, 33, 65)] == [1, 2, 4, 8, 24, 48, 96]
    assert batch_bucket(BATCH_BUCKETS[-1] + 1) is None
    assert [context_bucket(n) for n in (1, 128, 129, 300, 1024, 1025)] == [128, 128, 256, 512, 1024, 2048]


def test_bucketed_decode_gives_the_plain_tokens(tiny_model: Path) -> None:
    config = server_config(tiny_model, model={"device": "cpu"})
    plain = loaded_host(config)
    bucketed = loaded_host(config, plugins=[(BucketedBackend(), "bucketed")])
    want = run_engine(plain, requests())
    got = run_engine(bucketed, requests())
    for rid, out in want.items():
        assert got[rid].token_ids == out.token_ids, rid
    graphs = bucketed.backend.model.graphs
    assert plain.backend.model.graphs is None
    assert graphs is not None and graphs.replays >= 15
    assert (4, 128) in graphs.buckets  # four sequences decoding together
    assert (1, 256) in graphs.buckets  # the long one alone, past 128 tokens of context
    # the spare block the padded rows write to is not one the engine hands out
    kv = bucketed.backend.kv_caches[0][0]
    assert kv.shape[0] == (bucketed.llm.kv.num_blocks + 1) * bucketed.backend.block_size


def test_steps_outside_the_buckets_run_eagerly(tiny_model: Path) -> None:
    host = loaded_host(server_config(tiny_model, model={"device": "cpu"}), plugins=[(BucketedBackend(), "bucketed")])
    graphs = host.backend.model.graphs
    graphs.max_seqs = 2  # three sequences no longer fit a bucket
    reqs = requests()[:3]
    got = run_engine(host, reqs)
    assert graphs.replays == 0
    want = run_engine(loaded_host(server_config(tiny_model, model={"device": "cpu"})), requests()[:3])
    assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in want.items()}


@pytest.mark.parametrize("seqs", [1, 3])
def test_padded_rows_leave_the_cache_alone(tiny_model: Path, seqs: int) -> None:
    """A padded step writes only the real rows' slots and the scratch slot."""
    import torch

    host = loaded_host(server_config(tiny_model, model={"device": "cpu"}), plugins=[(BucketedBackend(), "bucketed")])
    backend = host.backend
    before = [k.clone() for k, _ in backend.kv_caches]
    from mindie_host.backends.base import ModelInput

    bs = backend.block_size
    batch = ModelInput(
        input_ids=[5] * seqs, positions=[3] * seqs, query_lens=[1] * seqs, context_lens=[4] * seqs,
        block_tables=[[i + 1] for i in range(seqs)], logits_indices=list(range(seqs)), row_variants=[-1] * seqs,
    )
    backend.execute(batch)
    scratch = backend.model.graphs.scratch_slot
    written = {(i + 1) * bs + 3 for i in range(seqs)} | ({scratch} if batch_bucket(seqs) != seqs else set())
    for (k, _), old in zip(backend.kv_caches, before):
        changed = set(torch.nonzero((k != old).flatten(1).any(dim=1)).flatten().tolist())
        assert changed == written


def test_a_bucket_without_memory_for_its_graph_runs_unpadded(tiny_model: Path) -> None:
    """Capture running out of device memory (the KV cache took most of it) costs speed, not the request."""
    import torch

    host = loaded_host(server_config(tiny_model, model={"device": "cpu"}), plugins=[(BucketedBackend(), "bucketed")])
    graphs = host.backend.model.graphs
    graphs.buckets.clear()
    graphs.use_graphs = True

    def capture(bucket: Any) -> None:
        if bucket.ids.shape[0] == 4:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    graphs._capture = capture  # other buckets "capture" nothing and run their padded step eagerly
    got = run_engine(host, requests())
    want = run_engine(loaded_host(server_config(tiny_model, model={"device": "cpu"})), requests())
    assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in want.items()}
    assert (4, 128) in graphs.failed and (4, 128) not in graphs.buckets
    assert not graphs.covers(4, 100) and graphs.covers(1, 200)
    assert graphs.replays == 0  # all four decoded together: every step ran unpadded
    solo = [EngineRequest("solo", [3, 1, 4, 1, 5], SamplingParams(max_tokens=6, ignore_eos=True))]
    assert run_engine(host, solo)["solo"].token_ids == run_engine(loaded_host(server_config(
        tiny_model, model={"device": "cpu"})), solo)["solo"].token_ids
    assert (1, 128) in graphs.buckets and graphs.replays == 5  # other buckets are still served
