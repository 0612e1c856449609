"""The output processor on the real tokenizer: several tokens appended in one call stop where a stop rule says,
and the stop rules, detokenization and output increments are those of one token at a time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from mindie_host.api import EngineRequest, SamplingParams
from mindie_host.engine.outputs import OutputProcessor
from mindie_host.engine.sequence import Sequence, SequenceStatus

PROMPT = [1, 504, 3458, 314, 260, 1831, 30]


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_model))


@pytest.fixture(scope="module")
def words(tokenizer: Any) -> list[int]:
    """Token ids of plain text: each decodes to at least one character."""
    return tokenizer.encode(" the sea is calm and the sky is blue", add_special_tokens=False)


def processor(tokenizer: Any) -> OutputProcessor:
    return OutputProcessor(tokenizer, [tokenizer.eos_token_id], len(tokenizer))


def sequence(proc: OutputProcessor, max_new: int = 100, **sampling: Any) -> Sequence:
    seq = Sequence(0, EngineRequest("r", list(PROMPT), SamplingParams(**sampling)), max_new)
    seq.status = SequenceStatus.RUNNING
    proc.start(seq)
    return seq


def one_by_one(proc: OutputProcessor, seq: Sequence, tokens: list[int]) -> tuple[int, str | None]:
    for i, token in enumerate(tokens):
        _, reason = proc.append_tokens(seq, [token], [None], 0.0)
        if reason is not None:
            return i + 1, reason
    return len(tokens), None


@pytest.mark.parametrize(
    "case",
    ["no stop", "stop token", "stop token kept", "stop string", "length", "eos before min_tokens"],
)
def test_several_tokens_at_once_end_as_one_at_a_time(tokenizer: Any, words: list[int], case: str) -> None:
    eos = tokenizer.eos_token_id
    tokens, sampling, max_new = list(words), {}, 100
    if case == "stop token":
        sampling = {"stop_token_ids": [words[3]]}
    elif case == "stop token kept":
        sampling = {"stop_token_ids": [words[3]], "include_stop_str_in_output": True}
    elif case == "stop string":
        sampling = {"stop": ["calm"]}
    elif case == "length":
        max_new = 4
    elif case == "eos before min_tokens":
        tokens = [words[0], eos, words[1], eos, words[2]]
        sampling = {"min_tokens": 2}
    proc = processor(tokenizer)
    together, alone = sequence(proc, max_new, **sampling), sequence(proc, max_new, **sampling)
    got = proc.append_tokens(together, tokens, [None] * len(tokens), 0.0)
    assert got == one_by_one(proc, alone, tokens)
    assert (together.token_ids, together.output_text, together.stop_reason) == (
        alone.token_ids,
        alone.output_text,
        alone.stop_reason,
    )
    expected = {
        "no stop": (len(tokens), None),
        "stop token": (4, "stop"),
        "stop token kept": (4, "stop"),
        "length": (4, "length"),
        "eos before min_tokens": (4, "stop"),
    }
    if case in expected:
        assert got == expected[case]
    if case == "stop token":
        assert together.output_token_ids == words[:3] and together.stop_reason == words[3]
    if case == "stop token kept":
        assert together.output_token_ids == words[:4]
    if case == "stop string":
        taken, reason = got
        assert reason == "stop" and together.stop_reason == "calm"
        assert together.output_text == tokenizer.decode(words[:taken]).split("calm")[0]
    if case == "eos before min_tokens":  # the first EOS is an output token, the second ends it and is dropped
        assert together.output_token_ids == [words[0], eos, words[1]]


def test_banned_tokens_until_min_tokens(tokenizer: Any, words: list[int]) -> None:
    proc = processor(tokenizer)
    seq = sequence(proc, min_tokens=2, stop_token_ids=[words[0], 10**9])  # an id past the vocabulary needs no ban
    assert sorted(proc.banned_tokens(seq) or []) == sorted([words[0], tokenizer.eos_token_id])
    proc.append_tokens(seq, words[1:3], [None, None], 0.0)
    assert proc.banned_tokens(seq) is None
    ignoring = sequence(proc, min_tokens=1, ignore_eos=True)
    assert proc.banned_tokens(ignoring) is None


def test_output_holds_back_text_that_may_start_a_stop_string(tokenizer: Any) -> None:
    proc = processor(tokenizer)
    tokens = tokenizer.encode(" blue sky", add_special_tokens=False)
    seq = sequence(proc, stop=["skyline"])
    proc.append_tokens(seq, tokens, [None] * len(tokens), 0.0)
    out = proc.make_output(seq)
    assert not out.finished and seq.output_text.endswith("sky")
    assert out.text == seq.output_text[: len(seq.output_text) - len("skyline") + 1]
    seq.status, seq.finish_reason = SequenceStatus.FINISHED, "length"
    last = proc.make_output(seq)
    assert last.finished and out.text + last.new_text == seq.output_text
    assert out.new_token_ids == tokens and last.new_token_ids == []
