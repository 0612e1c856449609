"""Speculative decoding over multi_lora variant rows: every verification row carries its sequence's variant.

A sequence with drafts brings its last token and each draft as a one-token decode row of its own; each such
row must run with the sequence's adapter, or a draft would be checked (and the next token chosen) by another
model. In one batch mixing two adapters and the base model, greedy output with drafts (a proposer right two
times in three, then ``llma``) equals the output without them, and drafts on each adapter are accepted.
"""

from __future__ import annotations

from pathlib import Path

import mindie_plugin_llma
from mindie_host.api import EngineRequest, ModelInput, SamplingParams
from mindie_host.testing import CopyProposer, loaded_host, run_engine, run_with_plugin
from multi_lora_helpers import PROMPTS, lora_config

MAX_NEW = 16
ADAPTERS = ("alpha", "beta", None)


def _requests() -> list[EngineRequest]:
    reqs = []
    for adapter in ADAPTERS:
        for i, prompt in enumerate(PROMPTS):
            req = EngineRequest(f"{adapter or 'base'}{i}", list(prompt),
                                SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
            if adapter:
                req.extensions["multi_lora"] = adapter  # what the plugin's request refinement sets
            reqs.append(req)
    return reqs


def test_drafts_on_mixed_adapter_rows_are_verified_by_their_own_adapter(lora_base: Path,
                                                                        lora_adapters: dict[str, Path]) -> None:
    host = loaded_host(lora_config(lora_base, maxLoras=4, maxLoraRank=16))
    try:
        plain = {rid: out.token_ids for rid, out in run_engine(host, _requests()).items()}
        for i in range(len(PROMPTS)):  # the adapters are in play (each is HF-checked in test_multi_lora_server)
            assert len({tuple(plain[f"{a or 'base'}{i}"]) for a in ADAPTERS}) == 3, i
        batches: list[ModelInput] = []
        execute = host.backend.execute

        def spy(batch: ModelInput) -> object:
            batches.append(batch)
            return execute(batch)

        host.backend.execute = spy  # type: ignore[method-assign]
        try:
            proposer = CopyProposer(plain)
            got = run_with_plugin(host, proposer, _requests())
        finally:
            del host.backend.execute
        assert {rid: out.token_ids for rid, out in got.items()} == plain
        accepted = {rid: 0 for rid in plain}
        for o in proposer.outcomes:
            accepted[o.request_id] += o.accepted
        for adapter in ADAPTERS:  # each adapter's and the base model's drafts were accepted
            assert sum(n for rid, n in accepted.items() if rid.startswith(adapter or "base")) > 0, adapter
        assert sum(o.proposed for o in proposer.outcomes) > sum(accepted.values())  # and some rejected
        # a step verified drafts on two adapters and the base model together, each row with its sequence's slot
        mixed = [b for b in batches if len(b.query_lens) > len(PROMPTS) * len(ADAPTERS)]
        assert any(len(set(b.row_variants)) == 3 and -1 in b.row_variants for b in mixed)
        stats = host.stats()
        assert stats["spec_accepted_tokens"] == sum(accepted.values())
        assert stats["lora_max_kinds_per_step"] >= 3

        # the llma plugin (n-gram lookup) in the same batch: the same tokens
        host.config.Plugins["llma"] = {"numSpeculativeTokens": 4, "minNgram": 1, "maxBatchSize": 16}
        before = host.llm.stats()["spec_draft_tokens"]
        got = run_with_plugin(host, mindie_plugin_llma, _requests(), name="llma")
        assert {rid: out.token_ids for rid, out in got.items()} == plain
        assert host.llm.stats()["spec_draft_tokens"] > before
    finally:
        host.shutdown()
