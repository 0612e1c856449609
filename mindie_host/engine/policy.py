"""Scheduling policy types and the host's built-in policies.

Each engine step the scheduler asks these hooks what to do:

* ``mindie_host_order_waiting`` puts the waiting queue in the order requests
  should be admitted (FCFS, priority, shortest/longest job first, ...), and
  ``mindie_host_order_running`` the running batch in the order it is served;
* ``mindie_host_plan_step`` picks which sequences run in this step and how many
  tokens each computes (a :class:`StepPlan`).

The built-in planner implements MindIE's ``Standard`` template: prefill and
decode never share a step. The ``splitfuse`` plugin provides the ``Mix`` template.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .kv_cache import KVCacheManager
from .sequence import SequenceView


@dataclass
class SchedulerLimits:
    """The batch limits a planner must respect (from ``ScheduleConfig``), and ``recompute_threshold``
    (``MIES_RECOMPUTE_THRESHOLD``), which the scheduler applies when a running sequence cannot grow."""

    max_batch_size: int
    max_prefill_batch_size: int
    max_prefill_tokens: int
    max_queue_delay_s: float
    support_select_batch: bool = False
    prefill_time_ms_per_req: int = 150
    decode_time_ms_per_req: int = 50
    recompute_threshold: float = 0.5

    @classmethod
    def from_schedule(cls, sc: Any, recompute_threshold: float = 0.5) -> SchedulerLimits:
        """The limits a ``ScheduleConfig`` sets, with ``MIES_RECOMPUTE_THRESHOLD``'s value."""
        return cls(
            max_batch_size=sc.maxBatchSize,
            max_prefill_batch_size=sc.maxPrefillBatchSize or sc.maxBatchSize,
            max_prefill_tokens=sc.maxPrefillTokens,
            max_queue_delay_s=sc.maxQueueDelayMicroseconds / 1e6,
            support_select_batch=sc.supportSelectBatch,
            prefill_time_ms_per_req=sc.prefillTimeMsPerReq,
            decode_time_ms_per_req=sc.decodeTimeMsPerReq,
            recompute_threshold=recompute_threshold,
        )


@dataclass
class SchedulerState:
    """What a planner sees when it builds one step.

    ``running`` sequences are admitted and hold KV blocks, ordered by ``mindie_host_order_running``.
    ``waiting`` is already ordered by ``mindie_host_order_waiting``. ``kv`` may be
    queried (``can_allocate``, ``blocks_needed``, ``num_free_blocks``) but not changed.
    ``memo`` is the planner's own scratch space, kept across steps.
    """

    running: list[SequenceView]
    waiting: list[SequenceView]
    kv: KVCacheManager
    limits: SchedulerLimits
    config: Any
    now: float
    memo: dict[str, Any] = field(default_factory=dict)


def least_urgent(running: list[SequenceView]) -> SequenceView:
    """The builtin preemption victim: highest ``priority`` number, then latest arrival."""
    return max(running, key=lambda s: (s.priority, s.arrival_time))


@dataclass
class StepPlan:
    """Sequences to compute in one step, with the number of tokens for each.

    A waiting sequence in the plan is admitted. A sequence whose planned tokens
    do not reach its end (a prefill chunk) gets no sampled token this step.
    """

    scheduled: list[tuple[SequenceView, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


# -- waiting-queue orders ----------------------------------------------------------------
def order_fcfs(waiting: list[SequenceView]) -> list[SequenceView]:
    """First come, first served."""
    return sorted(waiting, key=lambda s: s.arrival_time)


def order_priority(waiting: list[SequenceView]) -> list[SequenceView]:
    """Priority 1 (most urgent) to 5, then arrival."""
    return sorted(waiting, key=lambda s: (s.priority, s.arrival_time))


def order_shortest_first(waiting: list[SequenceView]) -> list[SequenceView]:
    """Shortest job first: fewest tokens to compute plus tokens still to generate."""
    return sorted(
        waiting, key=lambda s: (s.num_uncomputed + s.max_new_tokens - s.num_output_tokens, s.arrival_time)
    )


def order_longest_first(waiting: list[SequenceView]) -> list[SequenceView]:
    """Longest job first."""
    return sorted(
        waiting, key=lambda s: (-(s.num_uncomputed + s.max_new_tokens - s.num_output_tokens), s.arrival_time)
    )


def order_state(seqs: list[SequenceView]) -> list[SequenceView]:
    """STATE: sequences never preempted or swapped out first, then the others; arrival order within each."""
    return sorted(seqs, key=lambda s: (s.num_preemptions > 0, s.arrival_time))


def order_by_preemptions(seqs: list[SequenceView]) -> list[SequenceView]:
    """MLFQ as MindIE defines it, the combination of FCFS and STATE: one queue per number of times a sequence was
    preempted or swapped out (each preemption moves it down one), served from the top; arrival order within each."""
    return sorted(seqs, key=lambda s: (s.num_preemptions, s.arrival_time))


# -- the Standard template -----------------------------------------------------------------
def admit_prefills(state: SchedulerState, token_budget: int, seq_budget: int) -> list[tuple[SequenceView, int]]:
    """Take waiting sequences in order while token, batch and block budgets allow.

    The first candidate is always taken if blocks allow, even when its prompt is
    larger than the token budget, so a long (recomputed) prompt cannot starve.
    With nothing running it is taken even when the free count looks short: blocks
    pinned by other waiting sequences' cached prefixes are released by the engine
    to make room (and if room still cannot be made, the engine skips it).
    """
    picked: list[tuple[SequenceView, int]] = []
    free_blocks = state.kv.num_free_blocks()
    reserve = len(state.running)  # leave a block per running decode so admission doesn't force preemption
    for seq in state.waiting:
        if len(picked) >= seq_budget:
            break
        n = seq.num_uncomputed
        if picked and n > token_budget:
            break
        need = state.kv.blocks_needed(seq, n)
        if need > free_blocks - (reserve if state.running else 0) and (picked or state.running):
            break
        picked.append((seq, n))
        free_blocks -= need
        token_budget -= n
    return picked


def prefill_turn(state: SchedulerState) -> bool:
    """Whether this step should run prefills (True) or decodes (False) in the Standard template."""
    limits = state.limits
    if not state.waiting:
        return False
    decoding = len(state.running)
    if decoding == 0:
        return True
    if decoding >= limits.max_batch_size:
        return False
    if limits.support_select_batch:
        # MindIE's adaptive rule: compare what decodes lose by waiting for a prefill with
        # the accumulated waste of running under-full decode batches.
        wait = limits.prefill_time_ms_per_req * decoding
        waste = state.memo.get("decode_waste_ms", 0.0)
        if wait > waste:
            state.memo["decode_waste_ms"] = waste + limits.decode_time_ms_per_req * (
                limits.max_batch_size - decoding
            )
            return False
        state.memo["decode_waste_ms"] = 0.0
        return True
    # Prefill-first, but let a small prefill batch fill up for at most maxQueueDelay while
    # decodes keep running.
    room = min(limits.max_prefill_batch_size, limits.max_batch_size - decoding)
    oldest = min(s.arrival_time for s in state.waiting)
    full = len(state.waiting) >= room
    return full or (state.now - oldest) >= limits.max_queue_delay_s


def plan_standard(state: SchedulerState) -> StepPlan:
    """MindIE's ``Standard`` template: a step is either all prefills or all decodes."""
    limits = state.limits
    if prefill_turn(state):
        room = min(limits.max_prefill_batch_size, limits.max_batch_size - len(state.running))
        picked = admit_prefills(state, limits.max_prefill_tokens, room)
        if picked:
            return StepPlan(picked)
    batch = [(s, s.num_uncomputed) for s in state.running[: limits.max_batch_size] if s.num_uncomputed > 0]
    if not batch and state.waiting and not state.running:
        return StepPlan(admit_prefills(state, limits.max_prefill_tokens, limits.max_prefill_batch_size))
    return StepPlan(batch)
