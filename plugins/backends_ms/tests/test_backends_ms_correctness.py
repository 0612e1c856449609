"""The MindSpore backend against the torch backend: same weights, same paged-KV steps, same greedy tokens.

Each run drives both backends directly through the ``ModelBackend`` contract
(no engine, no sampling plugins): a batch of prompts is prefilled, then decoded
greedily for 32 steps (12 on the default model, whose steps are slow in MindSpore's PyNative mode); at every step the argmax tokens must be identical and the
float32 logits must agree within ``LOGIT_ATOL`` (absolute). The chunked-prefill
test covers what prefix_cache and splitfuse ask of a backend: new tokens that
attend to context already in the cache, mixed with decodes in one step.

Both backends run in a child process of the module (:func:`~mindie_host.testing.child_process`), which hands back
tokens and logit differences for the tests to assert on: what both allocate (2 GB on the default model) goes
back to the OS when the module ends, and the test process runs other modules after this one.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import Executor
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch
from mindie_plugin_backends_ms.backend import MsBackend
from mindie_plugin_backends_ms.model import build_step

from mindie_host.api import ModelInput, default_model_path, resolve_model
from mindie_host.backend_api import Platform, TorchBackend
from mindie_host.testing import child_process, make_tiny_llama

#: stated tolerance (README): max |logit_ms - logit_torch| at any step of a 32-token greedy run
LOGIT_ATOL = 2e-3
BLOCK = 16
STEPS = 32


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("ms-tiny"))


@pytest.fixture(scope="module")
def child() -> Iterator[Executor]:
    """The process both backends run in: it exits, and its memory is freed, when the module ends."""
    with child_process() as pool:
        yield pool


def _pair(path: str | Path, num_blocks: int = 64) -> tuple[TorchBackend, MsBackend]:
    """In the child: the float32 torch reference and the MindSpore backend on the same weights.

    The reference multiplies with torch's plain float32 products: without MKL's packed copies for batch-size
    buckets (four per matrix, which the engine keeps for speed) it holds 0.5 GB on the default model, not 3.4 GB."""
    os.environ["MINDIE_HOST_MKL_PACK"] = "0"  # this child's environment only
    source = resolve_model(path)
    ref = TorchBackend(source, name="ref", dtype="float32", quantization="none", platform=Platform())
    ref.load()
    ref.allocate_kv_cache(num_blocks, BLOCK)
    ms = MsBackend(source, name="ms")
    ms.load()
    ms.allocate_kv_cache(num_blocks, BLOCK)
    return ref, ms


class GreedyDriver:
    """Prefill a batch of prompts, then decode greedily, handing out cache blocks in order."""

    def __init__(self, prompts: list[list[int]], first_block: int = 0) -> None:
        self.seqs = [list(p) for p in prompts]
        self.tables: list[list[int]] = []
        next_block = first_block
        for p in prompts:
            need = -(-(len(p) + STEPS + 1) // BLOCK)
            self.tables.append(list(range(next_block, next_block + need)))
            next_block += need

    def prefill(self) -> ModelInput:
        ids: list[int] = []
        pos: list[int] = []
        last: list[int] = []
        for s in self.seqs:
            ids += s
            pos += list(range(len(s)))
            last.append(len(ids) - 1)
        lens = [len(s) for s in self.seqs]
        return ModelInput(input_ids=ids, positions=pos, query_lens=lens, context_lens=lens,
                          block_tables=self.tables, logits_indices=last)

    def decode(self) -> ModelInput:
        n = len(self.seqs)
        return ModelInput(input_ids=[s[-1] for s in self.seqs], positions=[len(s) - 1 for s in self.seqs],
                          query_lens=[1] * n, context_lens=[len(s) for s in self.seqs],
                          block_tables=self.tables, logits_indices=list(range(n)))

    def append(self, tokens: list[int]) -> None:
        for s, t in zip(self.seqs, tokens):
            s.append(t)


class Step(NamedTuple):
    """One greedy step of both backends, as the child saw it."""

    dtype: str  # of MindSpore's logits
    shape: tuple[int, ...]  # of MindSpore's logits
    ref_shape: tuple[int, ...]  # of torch's logits
    vocab: int
    diff: float  # max |logit_ms - logit_torch|
    torch_tokens: list[int]
    ms_tokens: list[int]


def _greedy_steps(path: str, prompts: list[list[int]], steps: int) -> list[Step]:
    """In the child: run both backends for ``steps`` greedy steps, following torch's tokens."""
    ref, ms = _pair(path)
    driver = GreedyDriver(prompts)
    batch = driver.prefill()
    out = []
    for _ in range(steps):
        a = ref.execute(batch)
        b = ms.execute(batch)
        ta, tb = a.argmax(-1).tolist(), b.argmax(-1).tolist()
        out.append(Step(str(b.dtype), tuple(b.shape), tuple(a.shape), ref.arch.vocab_size,
                        float((a - b).abs().max()), ta, tb))
        driver.append(ta)
        batch = driver.decode()
    return out


def _compare_greedy(child: Executor, path: str | Path, prompts: list[list[int]], steps: int = STEPS) -> float:
    """Run both for ``steps`` steps; assert identical tokens at every step; return the worst logit difference."""
    worst = 0.0
    for step, s in enumerate(child.submit(_greedy_steps, str(path), prompts, steps).result()):
        assert s.dtype == str(torch.float32) and s.shape == s.ref_shape == (len(prompts), s.vocab)
        worst = max(worst, s.diff)
        assert s.torch_tokens == s.ms_tokens, (
            f"step {step}: torch chose {s.torch_tokens}, ms chose {s.ms_tokens} (max logit diff {s.diff:.2e})")
        assert s.diff <= LOGIT_ATOL, f"step {step}: max logit difference {s.diff:.2e} > {LOGIT_ATOL}"
    return worst


def test_backends_ms_tiny_greedy_matches_torch(child: Executor, tiny_path: Path) -> None:
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 2000, n).tolist() for n in (5, 23, 40)]
    _compare_greedy(child, tiny_path, prompts)


def _default_model_prompts() -> list[list[int]]:
    from mindie_host.api import load_tokenizer

    tok = load_tokenizer(resolve_model(default_model_path()))
    texts = ["What is the capital of France?", "Write a haiku about the sea.", "1, 2, 3, 4,"]
    return [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                           add_generation_prompt=True))
        for t in texts
    ]


@pytest.mark.slow
def test_backends_ms_default_model_greedy_matches_torch(child: Executor) -> None:
    prompts = child.submit(_default_model_prompts).result()
    worst = _compare_greedy(child, default_model_path(), prompts, steps=12)  # the tiny model runs the full 32 steps
    assert worst < LOGIT_ATOL


class ChunkedRun(NamedTuple):
    """What the chunked-prefill test compares, computed in the child."""

    chunks: list[tuple[float, list[int], list[int]]]  # per chunk step: max logit diff, torch's and ms's argmax
    last_vs_whole: float  # the last token recomputed over the cached chunks, against torch's one-shot prefill
    ms_whole_vs_whole: float  # MindSpore's one-shot prefill against torch's


def _chunked_prefill(path: str) -> ChunkedRun:
    """In the child: a prompt fed in three chunks (with another sequence's prefill and decode mixed in)."""
    ref, ms = _pair(path)
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, 2000, 37).tolist()
    other = rng.integers(0, 2000, 9).tolist()
    # one-shot prefill of `prompt` in blocks 10.., for reference logits of its last token
    whole = ModelInput(input_ids=prompt, positions=list(range(37)), query_lens=[37], context_lens=[37],
                       block_tables=[[10, 11, 12]], logits_indices=[36])
    expect = ref.execute(whole)
    got_whole = ms.execute(whole)
    # chunked: 16 tokens, then 16 more mixed with `other`'s prefill, then 5 more mixed with `other`'s decode
    table, other_table = [20, 21, 22], [30]
    steps = [
        ModelInput(input_ids=prompt[:16], positions=list(range(16)), query_lens=[16], context_lens=[16],
                   block_tables=[table], logits_indices=[15]),
        ModelInput(input_ids=other + prompt[16:32], positions=list(range(9)) + list(range(16, 32)),
                   query_lens=[9, 16], context_lens=[9, 32], block_tables=[other_table, table],
                   logits_indices=[8, 24]),
        ModelInput(input_ids=[7] + prompt[32:], positions=[9] + list(range(32, 37)), query_lens=[1, 5],
                   context_lens=[10, 37], block_tables=[other_table, table], logits_indices=[0, 5]),
    ]
    chunks = []
    for batch in steps:
        a, b = ref.execute(batch), ms.execute(batch)
        chunks.append((float((a - b).abs().max()), a.argmax(-1).tolist(), b.argmax(-1).tolist()))
    last = ms.execute(ModelInput(input_ids=[prompt[-1]], positions=[36], query_lens=[1], context_lens=[37],
                                 block_tables=[table], logits_indices=[0]))
    return ChunkedRun(chunks, float((last - expect).abs().max()), float((got_whole - expect).abs().max()))


def test_backends_ms_chunked_prefill_over_cached_context(child: Executor, tiny_path: Path) -> None:
    """A prompt fed in three chunks (with a decode of another sequence mixed in) equals one-shot prefill."""
    run = child.submit(_chunked_prefill, str(tiny_path)).result()
    for diff, torch_tokens, ms_tokens in run.chunks:
        assert diff <= LOGIT_ATOL
        assert torch_tokens == ms_tokens
    # recomputing the last token over the cached chunks gives the one-shot prefill's logits
    assert run.last_vs_whole <= LOGIT_ATOL
    assert run.ms_whole_vs_whole <= LOGIT_ATOL


def test_backends_ms_step_inputs_mask_and_slots() -> None:
    """The host-side index inputs: slots follow the block table, the mask is causal over cached context."""
    batch = ModelInput(input_ids=[1, 2, 3, 4], positions=[5, 6, 7, 2], query_lens=[3, 1], context_lens=[8, 3],
                       block_tables=[[4, 1], [2]], logits_indices=[2, 3])
    step = build_step(batch, block_size=4, num_slots=100, num_kv_heads=2)
    # sequence 0: positions 5..7 live in block 1 (slots 5, 6, 7); sequence 1: position 2 in block 2 (slot 10)
    assert step.write_index.tolist() == [[5, 6, 7, 10], [105, 106, 107, 110]]
    assert step.read_index[0, 0].tolist() == [16, 17, 18, 19, 4, 5, 6, 7]
    visible = step.mask_bias[0, :, 0] == 0  # [B, max_q, max_ctx]
    assert visible[0, 0].tolist() == [True] * 6 + [False] * 2  # row 0 is position 5
    assert visible[0, 2].tolist() == [True] * 8
    assert visible[1, 0].tolist() == [True] * 3 + [False] * 5
    assert visible[1, 1].tolist() == [True] + [False] * 7  # padding row sees slot 0 only
    assert step.pad_source is not None and step.unpad_index is not None
    assert step.unpad_index.tolist() == [0, 1, 2, 3]
    assert step.pad_source.tolist() == [0, 1, 2, 3, 3, 3]
