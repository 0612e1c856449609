"""The ``llma`` plugin: n-gram lookup over a sequence's own tokens, and greedy output identical to decoding without it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mindie_plugin_llma
import pytest
from mindie_plugin_llma import NgramIndex

from mindie_host.api import DraftRequest, EngineRequest, PluginError, RequestError, SamplingParams, read_opt_out
from mindie_host.testing import loaded_host, run_engine, server_config


def test_lookup_proposes_what_followed_the_latest_longest_match() -> None:
    index = NgramIndex(1, 3)
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 7, 1, 2, 3]
    # "1 2 3" ended at 7 last (then 4 5 7 ...) and at 2 before: the latest wins
    assert index.propose(tokens, 3) == [4, 5, 7]
    tokens += [4, 5, 8]  # the index grows incrementally; "5 8" is new, "8" too: no match
    assert index.propose(tokens, 3) == []
    tokens += [1]  # a 1-gram matches at 11: what followed it there
    assert index.propose(tokens, 2) == [2, 3]
    assert NgramIndex(2, 2).propose([5, 6], 4) == []  # nothing before the suffix


def test_lookup_resumes_a_copy_at_its_cursor() -> None:
    """A copy that diverged (a renamed identifier) resumes where it had reached in the source, not at the latest
    occurrence of its last tokens (the instruction that named the new identifier)."""
    instruction = [50, 60, 70, 99]  # "... rename x to 60 70 ..."
    source = [1, 2, 3, 40, 60, 70, 5, 6, 7, 8]  # the code: "40" is the identifier being renamed
    index = NgramIndex(1, 2)
    tokens = instruction + source + [1, 2]
    assert index.propose(tokens, 1) == [3]  # "1 2" occurs once: what followed it
    index.accepted(1)  # the copy reached the source's "40"
    tokens += [3, 61]  # "3" accepted, then the model's own token "61" where the source has "40"
    assert index.propose(tokens, 4) == []  # "61" never occurred: a plain step
    tokens += [70]
    # "70" ended at 2 (the instruction, then 99) and at 9 (the source, then 5 6 7): the copy's place wins
    assert index.propose(tokens, 3) == [5, 6, 7]
    fresh = NgramIndex(1, 2)  # without a cursor, the latest occurrence
    assert fresh.propose(instruction + [70], 3) == [99, 70]


def test_a_short_match_proposes_few_drafts() -> None:
    """A match of at most ``short_match`` agreeing tokens is often chance: it proposes at most ``short_drafts``."""
    capped = NgramIndex(1, 3, short_match=2, short_drafts=2)
    assert capped.propose([5, 1, 2, 3, 4, 6, 7, 8, 9, 1], 8) == [2, 3]  # one token agrees
    assert capped.match == 1
    assert NgramIndex(1, 3, 2, 2).propose([5, 1, 2, 3, 4, 6, 7, 8, 9, 5, 1], 8) == [2, 3]  # two agree
    longer = [0, 5, 1, 2, 3, 4, 6, 7, 0, 5, 1]  # three agree: not short
    assert NgramIndex(1, 3, 2, 2).propose(longer, 5) == [2, 3, 4, 6, 7]
    # the tokens before the n-gram count too: a 1-gram whose two tokens before it agree as well
    one = NgramIndex(1, 1, 2, 2)
    assert one.propose(longer, 5) == [2, 3, 4, 6, 7] and one.match == 3
    assert NgramIndex(1, 3).propose([5, 1, 2, 3, 4, 6, 7, 8, 9, 1], 8) == [2, 3, 4, 6, 7, 8, 9, 1]  # no cap


def test_a_step_shares_its_draft_budget() -> None:
    """``maxStepDrafts`` is shared by the step's decoding sequences: k each alone, fewer each in a batch."""
    ctx = SimpleNamespace(params=mindie_plugin_llma.Params(numSpeculativeTokens=8, maxStepDrafts=8),
                          state=mindie_plugin_llma.State())
    tokens = list(range(1, 13)) + [1, 2, 3]  # "1 2 3" occurred before: nine tokens to copy

    def step(n: int) -> list[int] | None:
        seqs = [DraftRequest(i, f"r{n}-{i}", list(tokens), 13, SamplingParams(), {}, -1, 100) for i in range(n)]
        got = mindie_plugin_llma.mindie_host_propose_drafts(ctx, seqs)
        return None if got is None else [len(d.tokens) if d else 0 for d in got]

    assert step(1) == [8]
    assert step(2) == [4, 4]
    assert step(3) == [2, 2, 2]
    assert step(8) == [1] * 8
    assert step(9) is None  # over maxBatchSize: no drafts


def test_opt_out_field_is_validated() -> None:
    req = EngineRequest("a", [1], SamplingParams())
    read_opt_out(req, {"speculative_decoding": False})
    assert req.extensions["speculative_decoding"] is False
    with pytest.raises(RequestError) as err:
        read_opt_out(req, {"speculative_decoding": "no"})
    assert err.value.status == 400 and err.value.field == "speculative_decoding"


def test_params_are_validated(tiny_model: Path) -> None:
    cfg = server_config(tiny_model, model={"plugin_params": '{"plugin_type": "llma"}'},
                        plugins={"llma": {"minNgram": 4, "maxNgram": 2}})
    with pytest.raises(PluginError, match="minNgram"):
        loaded_host(cfg)


PROMPTS = [
    "Copy this exactly: alpha beta gamma delta epsilon zeta eta theta. Again: alpha beta gamma",
    "def area(r):\n    return 3.14 * r * r\n\n# rename r to radius\ndef area(radius):\n",
    "one two three four one two three four one two",
    "Hello",
]


@pytest.fixture(scope="module")
def host(tiny_model: Path) -> Any:
    """The tiny model; the test registers the plugin, with k=5 and matches of one token on."""
    host = loaded_host(server_config(tiny_model))
    host.config.Plugins["llma"] = {"numSpeculativeTokens": 5, "minNgram": 1}
    return host


def test_greedy_output_is_identical_with_lookup_drafts(host: Any) -> None:
    def reqs() -> list[EngineRequest]:
        return [EngineRequest(f"q{i}", host.tokenizer.encode(p), SamplingParams(max_tokens=24, ignore_eos=True))
                for i, p in enumerate(PROMPTS)]

    want = run_engine(host, reqs())
    host.plugins.register(mindie_plugin_llma, "llma")
    try:
        got = run_engine(host, reqs())
        assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in want.items()}
        stats = host.stats()  # the engine's counters and the plugin's gauges (/metrics, /metrics-json)
        assert stats["spec_draft_tokens"] > 0  # (a random model rarely copies: acceptance is tests/test_speculation.py's)
        assert stats["spec_decode_draft_tokens"] == stats["spec_draft_tokens"]
        state = host.plugins.state("llma")
        assert state.indexes == {} and state.k == {}  # released with the requests
        # a request that opts out gets no drafts
        before = host.llm.stats()["spec_draft_tokens"]
        req = reqs()[2]
        req.extensions["speculative_decoding"] = False
        assert run_engine(host, [req])["q2"].token_ids == want["q2"].token_ids
        assert host.llm.stats()["spec_draft_tokens"] == before
    finally:
        host.plugins.pm.unregister(mindie_plugin_llma)
        host.plugins.enabled.remove("llma")
