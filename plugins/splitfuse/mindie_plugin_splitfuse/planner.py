"""MindIE's ``Mix`` template: decodes and prefill chunks share every step.

Each step has a token budget, ``splitChunkTokens``. It is filled in this order:

1. every running sequence that is decoding (one token each), up to ``maxBatchSize``;
2. running sequences part-way through their prompt (the next chunk);
3. waiting sequences in the order ``mindie_host_order_waiting`` gave, admitted
   while the budget, the batch size and the free KV blocks allow.

A prompt that does not fit the rest of the budget is *split*: it gets what is
left and continues next step. The engine samples nothing for a sequence until
its last prompt token is computed, so outputs do not change, only when work
happens. Splitting follows MindIE's switches:

* ``splitStartBatchSize``: splitting starts once the step's batch (running
  sequences) reaches this size; before that a step admits whole prompts
  (bounded by ``maxPrefillTokens``) next to the decodes;
* ``splitStartType``: false = once started, splitting stays on; true = the
  start condition is checked again at every step;
* ``splitType``: true = only prompts longer than twice ``splitChunkTokens`` are
  split; shorter ones wait for a step with room for all of them;
* ``enableSplit`` false: ``Mix`` without splitting (whole prompts only).
"""

from __future__ import annotations

from typing import Any

from mindie_host.api import SchedulerState, SequenceView, StepPlan


def split_active(state: SchedulerState) -> bool:
    """Whether this step may split prompts (``enableSplit``, ``splitStartBatchSize``, ``splitStartType``)."""
    sch = state.config.schedule
    if not sch.enableSplit:
        return False
    started = len(state.running) >= sch.splitStartBatchSize
    if sch.splitStartType:
        return started
    if started:
        state.memo["splitfuse_started"] = True
    return bool(state.memo.get("splitfuse_started"))


def may_split(seq: SequenceView, chunk_tokens: int, split_type: bool) -> bool:
    """``splitType`` true splits only prompts longer than two chunks; a prompt already split continues."""
    if not split_type or seq.num_computed > 0:
        return True
    return seq.num_uncomputed > 2 * chunk_tokens


def plan_mix(state: SchedulerState) -> StepPlan:
    """Build one ``Mix`` step (see the module docstring)."""
    sch: Any = state.config.schedule
    max_batch = state.limits.max_batch_size
    splitting = split_active(state)
    budget = sch.splitChunkTokens if splitting else max(sch.splitChunkTokens, state.limits.max_prefill_tokens)
    plan: list[tuple[SequenceView, int]] = []
    free_blocks = state.kv.num_free_blocks()

    # 1. decodes first: one token each
    decodes = [s for s in state.running if s.num_uncomputed == 1]
    for seq in decodes[:max_batch]:
        plan.append((seq, 1))
        free_blocks -= state.kv.blocks_needed(seq, 1)
    budget -= len(plan)

    # 2. then prefills: running sequences mid-prompt, then waiting ones in queue order
    partial = [s for s in state.running if s.num_uncomputed > 1]
    partial_ids = {s.seq_id for s in partial}
    num_decodes = len(plan)
    for seq in [*partial, *state.waiting]:
        if len(plan) >= max_batch:
            break
        left = seq.num_uncomputed
        if left <= 0:
            continue
        first_prefill = len(plan) == num_decodes
        alone = not plan and not state.running  # nothing else could make progress
        if budget <= 0 and not alone:
            break
        n = left
        if n > budget:
            if seq.seq_id in partial_ids or (splitting and may_split(seq, sch.splitChunkTokens, sch.splitType)):
                n = max(1, budget)
            elif not (first_prefill and not splitting) and not alone:
                break  # keep queue order: a shorter prompt does not overtake
        need = state.kv.blocks_needed(seq, n)
        if seq.seq_id not in partial_ids and need > free_blocks and not alone:
            break  # wait for room rather than force preemption of running sequences
        plan.append((seq, n))
        free_blocks -= need
        budget -= n
    return StepPlan(plan)
