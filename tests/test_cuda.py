"""The CUDA path: the model, CUDA-graph decode and sampling on a GPU (skipped where there is none)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from mindie_host.api import EngineRequest, SamplingParams
from mindie_host.backends.base import ModelInput
from mindie_host.testing import LoadedHosts, RunningServer, run_engine, server_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


#: the hosts a test loaded, shut down after it (their device memory is freed before the next test)
_HOSTS = LoadedHosts()
_host = _HOSTS.load


@pytest.fixture(autouse=True)
def _shut_hosts_down() -> Iterator[None]:
    yield
    _HOSTS.shutdown()


def _requests(params: SamplingParams) -> list[EngineRequest]:
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [42] * 11, list(range(200, 320)), [7] * 40]
    return [EngineRequest(f"r{i}", p, params) for i, p in enumerate(prompts)]


def _cuda(tiny_model: Path, **model: object) -> dict:
    return server_config(tiny_model, model={"device": "cuda", "dtype": "float32", "npuMemSize": 1, **model})


def _prefill(prompts: list[list[int]], block_size: int) -> ModelInput:
    """One prefill step of ``prompts``, each in its own run of blocks from block 1."""
    ids, pos, tables, rows, next_block = [], [], [], [], 1
    for p in prompts:
        blocks = -(-len(p) // block_size)
        tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
        ids += p
        pos += list(range(len(p)))
        rows.append(len(ids) - 1)
    return ModelInput(input_ids=ids, positions=pos, query_lens=[len(p) for p in prompts],
                      context_lens=[len(p) for p in prompts], block_tables=tables, logits_indices=rows,
                      row_variants=[-1] * len(prompts))


def _decode(prompts: list[list[int]], prefill: ModelInput) -> ModelInput:
    """The decode step after ``prefill``: token 7 for every sequence."""
    n = len(prompts)
    return ModelInput(input_ids=[7] * n, positions=[len(p) for p in prompts], query_lens=[1] * n,
                      context_lens=[len(p) + 1 for p in prompts], block_tables=prefill.block_tables,
                      logits_indices=list(range(n)), row_variants=[-1] * n)


def test_cuda_logits_match_cpu_and_graph_logits_match_eager(tiny_model: Path) -> None:
    prompts = [r.prompt_token_ids for r in _requests(SamplingParams())]
    cpu = _host(server_config(tiny_model, model={"device": "cpu"})).backend
    gpu = _host(_cuda(tiny_model, compile=True)).backend
    assert gpu.platform.name == "cuda" and gpu.model.graphs is not None
    prefill = _prefill(prompts, cpu.block_size)
    want = cpu.execute(prefill)
    got = gpu.execute(prefill).cpu()
    assert torch.allclose(got, want, rtol=1e-3, atol=1e-3 * want.abs().max().item())
    step = _decode(prompts, prefill)
    want = cpu.execute(step)
    graphs = gpu.model.graphs
    replayed = gpu.execute(step).cpu()  # five sequences: a padded bucket of eight, from its graph
    assert graphs.replays == 1 and graphs.buckets[(8, 128)].graph is not None
    gpu.model.graphs = None
    eager = gpu.execute(step).cpu()  # the same step again (same K/V written), eagerly
    gpu.model.graphs = graphs
    assert torch.allclose(replayed, eager, rtol=1e-4, atol=1e-4 * eager.abs().max().item())
    assert torch.allclose(eager, want, rtol=1e-3, atol=1e-3 * want.abs().max().item())


def test_graph_decode_gives_the_eager_tokens(tiny_model: Path) -> None:
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    eager_host = _host(_cuda(tiny_model))
    graph_host = _host(_cuda(tiny_model, compile=True))
    assert eager_host.info.device == "cuda"
    eager = run_engine(eager_host, _requests(greedy))
    graphs = run_engine(graph_host, _requests(greedy))
    assert {r: o.token_ids for r, o in graphs.items()} == {r: o.token_ids for r, o in eager.items()}
    g = graph_host.backend.model.graphs
    assert eager_host.backend.model.graphs is None
    assert g is not None and g.use_graphs and g.replays >= 23
    assert all(b.graph is not None for b in g.buckets.values())


def test_seeded_sampling_and_penalties_on_cuda(tiny_model: Path) -> None:
    host = _host(_cuda(tiny_model, compile=True))
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=7, repetition_penalty=1.2,
                            frequency_penalty=0.5, presence_penalty=0.3, ignore_eos=True)
    first = run_engine(host, _requests(params))
    again = run_engine(host, _requests(params))
    assert {r: o.token_ids for r, o in first.items()} == {r: o.token_ids for r, o in again.items()}
    assert all(len(o.token_ids) == 16 for o in first.values())


def test_server_on_cuda_streams(tiny_model: Path) -> None:
    import httpx

    with RunningServer(_cuda(tiny_model, compile=True)) as server:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12,
                "temperature": 0, "stream": True}
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line.startswith("data:")]
        assert lines[-1] == "data: [DONE]" and len(lines) > 2
