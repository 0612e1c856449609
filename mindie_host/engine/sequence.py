"""Per-request sequence state inside the engine.

Scheduling and KV-cache plugins see sequences through the read-only
:class:`SequenceView` protocol; only the engine mutates a :class:`Sequence`.
"""

from __future__ import annotations

import enum
from typing import Any, Protocol

from .request import EngineRequest


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted, its KV in the CPU swap space
    TRANSFERRING = "transferring"  # PD decode side: its prompt KV is on its way from a P instance
    FINISHED = "finished"


class SequenceView(Protocol):
    """What scheduling and KV-cache plugins may read about a sequence.

    ``num_computed`` tokens already have KV in the cache; the next step may
    compute up to ``num_tokens - num_computed`` more. A sequence is *prefilling*
    while more than one token is left to compute.
    """

    seq_id: int
    request_id: str
    token_ids: list[int]
    prompt_len: int
    num_computed: int
    priority: int
    arrival_time: float
    num_preemptions: int
    cache_salt: str | None
    max_new_tokens: int
    span_keys: list[tuple[int, int, bytes]] | None  # extra prefix-cache keys per token span (EngineRequest.span_keys)

    @property
    def variant(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_uncomputed(self) -> int: ...

    @property
    def num_output_tokens(self) -> int: ...

    @property
    def is_prefill(self) -> bool: ...


class Sequence:
    """Mutable generation state of one request (the engine's own object)."""

    def __init__(self, seq_id: int, request: EngineRequest, max_new_tokens: int) -> None:
        self.seq_id = seq_id
        self.request = request
        self.request_id = request.request_id
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.prompt_len = len(self.token_ids)
        self.num_computed = 0
        self.num_cached_tokens = 0
        self.priority = request.priority
        self.arrival_time = request.arrival_time
        self.num_preemptions = 0
        self.cache_salt = request.cache_salt
        self.span_keys = request.span_keys
        self.max_new_tokens = max_new_tokens
        self.status = SequenceStatus.WAITING
        self.waiting_since = request.arrival_time
        # output bookkeeping (engine only)
        self.output_text = ""
        self.emitted_text_len = 0
        self.emitted_tokens = 0
        self.detok_state: Any = None
        self.generator: Any = None
        self.swap_blocks: list[int] = []  # swap-space blocks holding its KV while SWAPPED
        self.seed: int | None = request.sampling.seed  # the seed sampling uses (drawn when the request has none)
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.token_times: list[float] = []
        self.pending_logprobs: list[Any] = []
        self.prompt_logprobs: list[Any] | None = None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.error: str | None = None
        self.aborted = False

    @property
    def variant(self) -> int:
        """The model variant computing this sequence (-1 = base). Read from the request each step, so a
        plugin that binds a variant after the request was queued is seen."""
        return self.request.variant

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def is_prefill(self) -> bool:
        return self.num_uncomputed > 1

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed}, status={self.status.value})"
        )
