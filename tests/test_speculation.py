"""Speculative decoding's engine side (issue 38): drafts from the proposer hook, verified in one forward pass.

A test proposer that is often wrong (a reference continuation with every third token
corrupted, or random tokens) drives the engine over a tiny random model: greedy output is
token-identical to decoding without drafts, alone and in a batch, also with stop strings,
max_tokens, logprobs, a prefix cache and splitfuse chunks beside the verification rows; the KV of rejected drafts is rolled back (blocks freed,
the prefix cache keys only accepted tokens); under sampling, rejection sampling keeps the
target's distribution (chi-square against the exact distribution of the 2nd and 3rd tokens).
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from mindie_host import hookimpl
from mindie_host.api import DraftRequest, Drafts, EngineRequest, SamplingParams
from mindie_host.engine.outputs import OutputProcessor
from mindie_host.engine.speculation import Speculator
from mindie_host.testing import CopyProposer, loaded_host, run_engine, run_with_plugin, server_config

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "Once upon a time",
    "Summarise: the cat sat on the mat. The mat was red.",
    "a b c a b c a b",
]


def requests(host: Any, prefix: str = "r", **sampling: Any) -> list[EngineRequest]:
    tok = host.tokenizer
    params = {"max_tokens": 16, "ignore_eos": True, **sampling}
    return [EngineRequest(f"{prefix}{i}", tok.encode(p), SamplingParams(**params)) for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def host(tiny_model: Path) -> Any:
    """The tiny model with the prefix cache (small blocks) and splitfuse (8-token prompt chunks beside the
    verification rows) on, so every test also runs beside them."""
    return loaded_host(server_config(
        tiny_model, schedule={"maxBatchSize": 256, "maxPrefillBatchSize": 64, "enablePrefixCache": True,
                              "cacheBlockSize": 4, "templateType": "Mix", "enableSplit": True,
                              "splitChunkTokens": 8, "splitStartBatchSize": 0},
        model={"plugin_params": '{"plugin_type": "prefix_cache,splitfuse"}'}))


@pytest.fixture(scope="module")
def reference(host: Any) -> dict[str, Any]:
    """The outputs without drafts, each request alone (c=1)."""
    out: dict[str, Any] = {}
    for req in requests(host, logprobs=2):
        out.update(run_engine(host, [req]))
    return out


def test_greedy_output_with_drafts_is_token_identical_alone_and_batched(host: Any, reference: dict[str, Any]) -> None:
    ref_ids = {rid: out.token_ids for rid, out in reference.items()}
    for alone in (True, False):
        proposer = CopyProposer(ref_ids)
        got = run_with_plugin(host, proposer, requests(host, logprobs=2), alone=alone)
        for rid, out in reference.items():
            assert got[rid].token_ids == out.token_ids, (alone, rid)
            # the logprobs are the target's: those of plain decoding (this float32 model's dense products are
            # not row-invariant in the last bits; test_verification_rows_are_decode_rows checks bits)
            for a, b in zip(got[rid].logprobs, out.logprobs, strict=True):
                assert [t for t, _ in a.top] == [t for t, _ in b.top], rid
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4), rid
        accepted = sum(o.accepted for o in proposer.outcomes)
        proposed = sum(o.proposed for o in proposer.outcomes)
        assert 0 < accepted < proposed  # some drafts were right, some wrong
        assert host.llm.kv.num_used_blocks() == 0  # every block came back, the drafts' too
    stats = host.llm.stats()
    assert stats["spec_accepted_tokens"] > 0 and stats["spec_draft_tokens"] > stats["spec_accepted_tokens"]


def test_random_drafts_stop_strings_and_max_tokens(host: Any, reference: dict[str, Any]) -> None:
    """A proposer that is nearly always wrong changes nothing; a stop string inside an accepted run stops there."""
    rng = random.Random(0)

    class RandomProposer:
        @hookimpl
        def mindie_host_propose_drafts(self, ctx: Any, seqs: list[DraftRequest]) -> list[Drafts | None]:
            return [Drafts([rng.randrange(1000) for _ in range(s.max_drafts)]) for s in seqs]

    got = run_with_plugin(host, RandomProposer(), requests(host, max_tokens=7))
    for rid, out in reference.items():
        assert got[rid].token_ids == out.token_ids[:7] and got[rid].finish_reason == "length"
    # a stop string: cut where plain decoding cuts it, with drafts running past it
    text = reference["r0"].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    plain = run_engine(host, requests(host, "s", stop=[stop])[:1])["s0"]
    spec = run_with_plugin(host, CopyProposer({"s0": reference["r0"].token_ids}, k=8, every=100),
                         requests(host, "s", stop=[stop])[:1])["s0"]
    assert spec.finish_reason == plain.finish_reason == "stop"
    assert (spec.text, spec.token_ids) == (plain.text, plain.token_ids)


def test_prefix_cache_keys_only_accepted_tokens(host: Any, reference: dict[str, Any]) -> None:
    from mindie_plugin_prefix_cache import PrefixCachingKVCacheManager

    kv = host.llm.kv
    assert isinstance(kv, PrefixCachingKVCacheManager)
    keyed: list[list[int]] = []
    on_computed = kv.on_computed

    def check(seq: Any) -> None:  # a block is keyed only once all its tokens are accepted and computed
        on_computed(seq)
        n = len(kv._chain.get(seq.seq_id, [])) * kv.block_size
        assert n <= seq.num_computed <= len(seq.token_ids)
        keyed.append(list(seq.token_ids[:n]))

    kv.on_computed = check  # type: ignore[method-assign]
    try:
        ref = {rid: out.token_ids for rid, out in reference.items()}
        got = run_with_plugin(host, CopyProposer(ref, k=6), requests(host, "p")[:2])
    finally:
        del kv.on_computed
    for rid, prompt in zip(("p0", "p1"), PROMPTS):
        assert got[rid].token_ids == ref["r" + rid[1:]]
        full = host.tokenizer.encode(prompt) + ref["r" + rid[1:]]
        assert any(len(k) > len(full) - 20 for k in keyed)  # blocks of generated tokens were keyed
        assert all(k == full[: len(k)] for k in keyed if k[:3] == full[:3])
    assert kv.num_used_blocks() == 0


def test_verification_rows_are_decode_rows(tmp_path: Path, cpu_variant: Any) -> None:
    """On a batch-invariant (low-bit) model, a sequence's verification rows carry the bits of plain decode
    steps at those positions, alone and beside another sequence's rows, on every kernel variant this CPU runs,
    for 1, 2 and 4 drafts (2, 3 and 5 rows: the low-bit products' two-row, register and six-row paths; beside
    another sequence 4, 6 and 10 rows, the last through the buffered path)."""
    from test_low_bit_weights import VOCAB, loaded, write_tiny_gguf

    from mindie_host.backends.base import ModelInput

    backend = loaded(write_tiny_gguf(tmp_path / "tiny.gguf"), "auto")
    ctx, tokens = 20, [5, 17, 42, 9, 33]
    prompt = [(7 * t + 3) % VOCAB for t in range(ctx)]

    def prefill(table: list[int]) -> None:
        backend.execute(ModelInput(input_ids=prompt, positions=list(range(ctx)), query_lens=[ctx],
                                   context_lens=[ctx], block_tables=[table], logits_indices=[ctx - 1],
                                   row_variants=[-1], prompt_lens=[ctx]))

    prefill([0, 1])
    sequential = torch.cat([backend.execute(ModelInput(
        input_ids=[t], positions=[ctx + j], query_lens=[1], context_lens=[ctx + j + 1], block_tables=[[0, 1]],
        logits_indices=[0], row_variants=[-1], prompt_lens=[ctx])) for j, t in enumerate(tokens)])
    for rows in (2, 3, 5):
        drafts = tokens[:rows]
        for other in (False, True):
            prefill([2, 3])
            n = rows * (2 if other else 1)
            tables = [[2, 3]] * rows + [[4, 5]] * (n - rows)
            positions = [ctx + j for j in range(rows)] * (n // rows)
            verified = backend.execute(ModelInput(
                input_ids=(drafts + drafts[::-1])[:n], positions=positions, query_lens=[1] * n,
                context_lens=[p + 1 for p in positions], block_tables=tables, logits_indices=list(range(n)),
                row_variants=[-1] * n, prompt_lens=[ctx] * n))
            assert torch.equal(verified[:rows], sequential[:rows]), (rows, other)


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    """Chi-square over draws of the 2nd and 3rd tokens at a fixed context (4,000 here; SPEC_DRAWS=20000 for the
    issue's count, ~4x the time), through the verifier the engine
    runs, with a target whose next-token law depends on the previous token (a Markov chain over 6 tokens, with
    penalties, temperature and top-k in its processed distribution) and drafts that are often wrong: a sampling
    proposer with its own q for the 1st draft, a deterministic one (q one-hot) for the 2nd."""
    from scipy.stats import chisquare

    from mindie_host.engine.sampling import constrain_row, filter_logits
    from mindie_host.engine.sequence import Sequence

    vocab = 6
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(vocab, vocab, generator=gen) * 1.5  # logits of the next token given the previous one
    params = SamplingParams(temperature=0.8, do_sample=True, top_k=4, presence_penalty=0.7, max_tokens=3,
                            ignore_eos=True)
    prompt = [0, 3]

    def processed(tokens: list[int]) -> torch.Tensor:
        row = table[tokens[-1]].clone()
        constrain_row(row, params, tokens[:2], tokens[2:], None, None)
        return filter_logits(row, params)

    # the exact law of (t1, t2, t3)
    law2 = torch.zeros(vocab)
    law3 = torch.zeros(vocab)
    p1 = processed(prompt)
    for t1 in range(vocab):
        p2 = processed(prompt + [t1])
        for t2 in range(vocab):
            law2[t2] += p1[t1] * p2[t2]
            law3 += p1[t1] * p2[t2] * processed(prompt + [t1, t2])
    outputs = OutputProcessor(None, [], vocab)
    spec = Speculator(None, None, outputs, None, vocab)  # type: ignore[arg-type]
    q1 = torch.softmax(torch.randn(vocab, generator=gen), dim=-1)  # the proposer's own (wrong) law
    draws = int(os.environ.get("SPEC_DRAWS", "4000"))
    seen2 = torch.zeros(vocab)
    seen3 = torch.zeros(vocab)
    accepted = 0
    for n in range(draws):
        seq = Sequence(n, EngineRequest(str(n), list(prompt), params), 3)
        seq.generator = torch.Generator().manual_seed(n)
        while seq.num_output_tokens < 3:  # the engine's loop: drafts, one row per draft plus one, verify
            d1 = int(torch.multinomial(q1, 1, generator=gen))
            drafts = Drafts([d1, (d1 + 1) % vocab][: 2 - seq.num_output_tokens],
                            None)
            probs = torch.stack([q1, torch.nn.functional.one_hot(torch.tensor((d1 + 1) % vocab), vocab).float()])
            drafts.probs = probs[: len(drafts.tokens)]
            context = list(seq.token_ids)
            rows = torch.stack([table[t] for t in [context[-1], *drafts.tokens]])
            tokens, _, a = spec.verify(seq, rows, drafts)
            accepted += a
            seq.token_ids.extend(tokens[: 3 - seq.num_output_tokens])
        seen2[seq.token_ids[3]] += 1
        seen3[seq.token_ids[4]] += 1
    assert 0 < accepted < 2 * draws
    for seen, law in ((seen2, law2), (seen3, law3)):
        keep = law > 0
        assert seen[~keep].sum() == 0
        stat, pvalue = chisquare(seen[keep].numpy(), (law[keep] / law[keep].sum() * draws).numpy())
        assert pvalue > 1e-3, (stat, pvalue, seen, law * draws)


def test_speculator_refuses_malformed_drafts(host: Any) -> None:
    """Token ids outside the vocabulary are dropped (logged), the step decodes normally."""
    spec = Speculator(host.plugins.hook, host.llm.kv, OutputProcessor(host.tokenizer, [], 10), host.llm.counters, 10)

    class Bad:
        @hookimpl
        def mindie_host_propose_drafts(self, ctx: Any, seqs: list[DraftRequest]) -> list[Drafts | None]:
            return [Drafts([10**9])] * len(seqs)

    reqs = requests(host, "m", max_tokens=5)[:1]
    before = host.llm.counters["spec_proposer_errors"]
    got = run_with_plugin(host, Bad(), reqs)
    assert len(got["m0"].token_ids) == 5
    assert host.llm.counters["spec_proposer_errors"] > before
    assert spec.active() is False


def test_a_constraint_that_cannot_fork_is_not_offered(host: Any) -> None:
    """A request whose logits constraint has no ``fork`` (its state only moves forward) decodes without drafts
    beside one that takes them."""
    offered: set[str] = set()

    class Recorder:
        @hookimpl
        def mindie_host_propose_drafts(self, ctx: Any, seqs: list[DraftRequest]) -> list[Drafts | None]:
            offered.update(s.request_id for s in seqs)
            return [Drafts([1, 2]) for _ in seqs]

    reqs = requests(host, "g", max_tokens=6)[:2]
    reqs[0].logits_constraint = lambda ids: None
    got = run_with_plugin(host, Recorder(), reqs)
    assert offered == {"g1"} and all(len(o.token_ids) == 6 for o in got.values())


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "n": {"type": "integer"},
                                           "ok": {"type": "boolean"}}, "required": ["name", "n", "ok"]}


def constrained(host: Any, prefix: str) -> list[EngineRequest]:
    """Greedy requests under the builtin JSON constraint and under llguidance's (a regex), fresh constraints."""
    from mindie_host.structured.json_grammar import JsonConstraint
    from mindie_host.structured.llg import GrammarConstraint
    from mindie_host.structured.spec import StructuredSpec

    reqs = requests(host, prefix, max_tokens=24, ignore_eos=False)[:4]
    for i, req in enumerate(reqs):
        req.logits_constraint = (JsonConstraint.for_schema(host, SCHEMA) if i % 2 == 0 else GrammarConstraint.for_spec(
            host, StructuredSpec("regex", r"(yes|no|maybe)( [a-z]{1,6}){2,5}\.", "guided_regex")))
    return reqs


def test_constrained_drafts_are_cut_at_the_grammar_and_verified_under_its_mask(host: Any) -> None:
    """Structured outputs take drafts: each is checked on a fork of the constraint (cut at the first token the
    grammar refuses), and each verification row is masked as plain decoding masks its row, so the output is the
    output without drafts (each reference request alone; with drafts, batched)."""
    reference: dict[str, Any] = {}
    for req in constrained(host, "c"):
        reference.update(run_engine(host, [req]))
    ref_ids = {rid: out.token_ids for rid, out in reference.items()}
    assert all(len(ids) > 3 for ids in ref_ids.values())
    # every third draft corrupted: (t + 7) % 1000 is mostly outside the grammar, so drafts are also cut there
    proposer = CopyProposer(ref_ids)
    before = host.llm.counters["spec_draft_tokens"]
    got = run_with_plugin(host, proposer, constrained(host, "c"))
    assert {rid: out.token_ids for rid, out in got.items()} == ref_ids
    accepted = sum(o.accepted for o in proposer.outcomes)
    proposed = sum(o.proposed for o in proposer.outcomes)
    assert accepted > 0 and proposed > 0
    assert host.llm.counters["spec_draft_tokens"] - before == proposed
    assert host.llm.kv.num_used_blocks() == 0
    # a proposer of tokens the grammar never allows first (a draft of EOS right away) gets nothing verified
    eos = host.tokenizer.eos_token_id

    class Refused:
        @hookimpl
        def mindie_host_propose_drafts(self, ctx: Any, seqs: list[DraftRequest]) -> list[Drafts | None]:
            return [Drafts([eos, eos]) if len(s.token_ids) == s.prompt_len + 1 else None for s in seqs]

    before_drafts = host.llm.counters["spec_draft_tokens"]
    got = run_with_plugin(host, Refused(), constrained(host, "c"))
    assert {rid: out.token_ids for rid, out in got.items()} == ref_ids
    assert host.llm.counters["spec_draft_tokens"] == before_drafts
