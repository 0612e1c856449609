"""The PD handoff on its own, over the builtin TCP connector: it keeps the books of held and pulled KV and reports
what the engine must do as events (free held blocks, end a request), changing no engine state itself."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from mindie_host.api import EngineRequest, SamplingParams
from mindie_host.engine.handoff import HOLD_SECONDS, Arrival, Handoff, HoldEnded, PullFailed
from mindie_host.engine.kv_transfer import KVLayout
from mindie_host.engine.request import KVTransfer
from mindie_host.engine.sampling import make_generator
from mindie_host.engine.sequence import Sequence
from mindie_host.pd.tcp_connector import TCPConnector

BLOCK = 4
LAYOUT = KVLayout(
    model="m",
    num_layers=1,
    num_kv_heads=1,
    head_dim=2,
    dtype="float32",
    block_size=BLOCK,
    block_shapes=[[BLOCK, 1, 2], [BLOCK, 1, 2]],
)
#: P's cache: a K and a V tensor of 16 blocks, each block's values telling it apart
CACHE = [torch.arange(16 * BLOCK * 2, dtype=torch.float32).reshape(16, BLOCK, 1, 2) + k for k in (0.0, 0.5)]


def read_blocks(blocks: list[int]) -> list[torch.Tensor]:
    index = torch.tensor(blocks)
    return [t.index_select(0, index) for t in CACHE]


@pytest.fixture
def pair() -> Any:
    p, d = TCPConnector("127.0.0.1", "127.0.0.1"), TCPConnector("127.0.0.1", "127.0.0.1")
    address = p.start(LAYOUT, read_blocks)
    d.start(LAYOUT, read_blocks)
    yield Handoff(p), Handoff(d), address
    p.close()
    d.close()


def sequence(rid: str, prompt: list[int], transfer: KVTransfer | None = None, seed: int | None = None) -> Sequence:
    req = EngineRequest(rid, prompt, SamplingParams(do_sample=seed is not None, seed=seed))
    req.kv_transfer = transfer
    seq = Sequence(0, req, 10)
    if seed is not None:
        seq.seed, seq.generator = seed, make_generator(seed)
    return seq


def poll_until(handoff: Handoff, done: Callable[[list[Any]], bool], now: float | None = None) -> list[Any]:
    events: list[Any] = []
    deadline = time.monotonic() + 20
    while not done(events):
        assert time.monotonic() < deadline, "the transfer did not finish"
        events.extend(handoff.poll(time.monotonic() if now is None else now))
        time.sleep(0.005)
    return events


def exported(p: Handoff, rid: str, prompt: list[int], seed: int | None = 7) -> Sequence:
    """A P sequence with its first token sampled (its generator advanced), offered to D."""
    seq = sequence(rid, prompt, KVTransfer("export", handle=rid), seed)
    if seq.generator is not None:
        torch.rand(3, generator=seq.generator)
    seq.token_ids.append(42)
    p.export(seq, [9, 3, 12, 5], BLOCK)
    return seq


def test_d_takes_p_kv_and_sampling_state_and_p_is_told_to_free(pair: Any) -> None:
    p, d, address = pair
    prompt = list(range(100, 110))  # 10 tokens: the first 3 of 4 blocks
    sent = exported(p, "r1", prompt)
    assert list(p.held) == ["r1"] and p.busy()
    taker = sequence("r1", prompt, KVTransfer("import", source=address, handle="r1"), seed=1)
    d.start_import(taker)
    assert d.waiting_sequences() == [taker]
    assert poll_until(d, lambda _: d.oldest_arrival() is not None) == []
    arrival = d.oldest_arrival()
    assert isinstance(arrival, Arrival) and arrival.seq is taker and arrival.first_token == 42
    assert arrival.num_blocks == 3
    for got, want in zip(arrival.tensors, read_blocks([9, 3, 12])):
        assert torch.equal(got, want)
    arrival.restore_sampling()
    assert taker.seed == 7 and torch.equal(taker.generator.get_state(), sent.generator.get_state())
    assert d.take_arrival() is arrival and not d.busy()
    events = poll_until(p, lambda ev: bool(ev))  # D acknowledged the copy
    assert events == [HoldEnded(sent)] and not p.busy()


def test_a_failed_or_refused_pull_ends_the_request(pair: Any) -> None:
    p, d, address = pair
    exported(p, "r2", list(range(10)))
    other = sequence("r2", list(range(1, 11)), KVTransfer("import", source=address, handle="r2"))
    d.start_import(other)
    events = poll_until(d, lambda ev: bool(ev))
    assert len(events) == 1 and isinstance(events[0], PullFailed) and events[0].seq is other
    assert "tokenized the prompt differently" in events[0].message
    unknown = sequence("nope", [1, 2], KVTransfer("import", source=address, handle="nope"))
    d.start_import(unknown)
    events = poll_until(d, lambda ev: bool(ev))
    assert isinstance(events[0], PullFailed) and events[0].seq is unknown and "failed" in events[0].message
    assert not d.busy()


def test_holds_expire_and_release_returns_the_sequence(pair: Any) -> None:
    p, d, address = pair
    first = exported(p, "a", list(range(8)), seed=None)
    second = exported(p, "b", list(range(8)), seed=None)
    assert p.release("b", "aborted") is second and p.release("b", "aborted") is None
    events = p.poll(time.monotonic() + HOLD_SECONDS + 1)
    assert events == [HoldEnded(first)] and not p.busy()
    late = sequence("a", list(range(8)), KVTransfer("import", source=address, handle="a"))
    d.start_import(late)  # withdrawn: P refuses it
    assert isinstance(poll_until(d, lambda ev: bool(ev))[0], PullFailed)


def test_a_sequence_that_ends_while_pulling_is_forgotten(pair: Any) -> None:
    p, d, address = pair
    exported(p, "f", list(range(8)), seed=None)
    seq = sequence("f", list(range(8)), KVTransfer("import", source=address, handle="f"))
    d.start_import(seq)
    d.forget(seq)
    assert not d.busy() and d.waiting_sequences() == []
