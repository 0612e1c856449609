"""The scheduler: which live sequences hold KV blocks, and which of them compute in each step.

:class:`Scheduler` owns the queues (waiting, running, swapped) and every state change of a
sequence between arrival and finish: admission, preemption (by recomputation, or by swapping
its KV out to the CPU swap space and back), and the end. A running sequence the pool cannot grow
is preempted only when the step's dispatchable sequences hold less than ``MIES_RECOMPUTE_THRESHOLD``
of the cache (:meth:`Scheduler._recompute_now`); otherwise it waits a step with its blocks. It decides nothing by itself: the
policy hooks order and filter the waiting queue, plan the step (``mindie_host_plan_step``) and
pick preemption victims; the scheduler applies their answers against the KV-cache manager
(the block manager), preempting when the pool runs dry. A sequence whose computed KV comes
from elsewhere (a KV connector) waits outside the queues until :meth:`Scheduler.reserve` and
:meth:`Scheduler.start_running` admit it.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from ..backends.base import ModelBackend
from .kv_cache import KVCacheManager
from .policy import SchedulerLimits, SchedulerState, StepPlan, least_urgent
from .sequence import Sequence, SequenceStatus
from .swap import SwapSpace

log = logging.getLogger("mindie_host.engine")


class Scheduler:
    """The queues of live sequences, turned each step into a plan the KV cache can hold.

    :ivar waiting: admitted to the engine but holding no blocks (new, or preempted to recompute), in queue order.
    :ivar running: holding KV blocks, in the order ``mindie_host_order_running`` gave (admission order at first).
    :ivar swapped: preempted with their KV in the swap space, oldest first.
    :ivar by_request: every live sequence by request id, also those outside the queues (KV on its way).
    :ivar counters: the engine's counters (shared), for preemptions, swaps and finishes.
    """

    def __init__(
        self,
        kv: KVCacheManager,
        limits: SchedulerLimits,
        hook: Any,
        config: Any,
        backend: ModelBackend,
        counters: Counter[str],
        swap: SwapSpace | None = None,
    ) -> None:
        self.kv = kv
        self.limits = limits
        self.hook = hook
        self.config = config
        self.backend = backend  # copies blocks to and from the swap space
        self.counters = counters
        self.swap = swap
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.by_request: dict[str, Sequence] = {}
        #: the planner's scratch space, kept across steps (``SchedulerState.memo``)
        self.plan_memo: dict[str, Any] = {}
        self._swaps_this_step = 0
        self._recompute: bool | None = None  # this step's MIES_RECOMPUTE_THRESHOLD decision, once asked

    # -- queues ---------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence at the back of the waiting queue."""
        self.by_request[seq.request_id] = seq
        self.waiting.append(seq)

    def add_transferring(self, seq: Sequence) -> None:
        """Register a sequence whose prompt KV is on its way from elsewhere; it joins no queue until
        :meth:`reserve` and :meth:`start_running` admit it."""
        self.by_request[seq.request_id] = seq
        seq.status = SequenceStatus.TRANSFERRING

    def has_work(self) -> bool:
        """Whether any queue holds a sequence."""
        return bool(self.waiting or self.running or self.swapped)

    def queued(self) -> list[Sequence]:
        """The sequences in the queues: running, then waiting, then swapped."""
        return [*self.running, *self.waiting, *self.swapped]

    # -- one step ---------------------------------------------------------------------------------
    def schedule(self, now: float) -> StepPlan:
        """This step's plan: bring swapped sequences back, ask the policy hooks, and allocate blocks for
        what they planned, in plan order (preempting when the pool runs dry). Every sequence in the
        returned plan is running and has blocks for its planned tokens."""
        self._swaps_this_step = 0
        self._recompute = None
        if self.swapped:
            self._swap_in()
        if len(self.waiting) > 1:
            ordered = self.hook.mindie_host_order_waiting(waiting=list(self.waiting), now=now)
            if ordered is not None:
                self.waiting = list(ordered)
        if self.running:
            ordered = self.hook.mindie_host_order_running(running=list(self.running), now=now)
            if ordered is not None:
                self.running = list(ordered)
        for seq in self.waiting[: self.limits.max_batch_size]:
            if seq.request.sampling.prompt_logprobs is None:
                # what the cache could supply now (a pure query: the blocks are held only on admission);
                # a request scoring its prompt computes every position: cached blocks give no logits
                seq.num_computed = self.kv.match_prefix(seq)
        waiting = list(self.waiting)
        if waiting:
            for allowed in self.hook.mindie_host_filter_waiting(waiting=list(waiting)):
                if allowed is not None:
                    keep = {s.seq_id for s in allowed}
                    waiting = [s for s in waiting if s.seq_id in keep]
        state = SchedulerState(
            running=list(self.running),
            waiting=waiting,
            kv=self.kv,
            limits=self.limits,
            config=self.config,
            now=now,
            memo=self.plan_memo,
        )
        plan = self.hook.mindie_host_plan_step(state=state) or StepPlan()
        return self._apply_plan(plan, now)

    def mark_computed(self, plan: StepPlan) -> None:
        """The step ran: the planned tokens of every sequence in ``plan`` now have KV in the cache."""
        for seq, n in plan.scheduled:
            seq.num_computed += n
            self.kv.on_computed(seq)

    def _apply_plan(self, plan: StepPlan, now: float) -> StepPlan:
        """Allocate blocks in plan order, preempting running sequences if the pool runs dry."""
        done: list[tuple[Sequence, int]] = []
        in_step: set[int] = set()
        preempted: set[int] = set()
        stalled = False
        for view, n in plan.scheduled:
            seq = self.by_request.get(view.request_id)
            if seq is None or seq.status == SequenceStatus.FINISHED or seq.seq_id in preempted or n <= 0:
                continue
            if seq.status == SequenceStatus.WAITING:
                if stalled:  # blocks that come free go to the running sequences left waiting first
                    continue
                self._acquire_prefix(seq)
            n = min(n, seq.num_uncomputed)
            if (seq.status == SequenceStatus.RUNNING and not self.kv.can_allocate(seq, n)
                    and not self._recompute_now(plan)):
                stalled = True  # it keeps its blocks and computes in a later step
                self.counters["stalls"] += 1
                continue
            while not self.kv.can_allocate(seq, n):
                # a running sequence that cannot grow is itself a candidate: the policy may keep it over another
                victim = self._pick_victim(seq, exclude=in_step)
                if victim is None:
                    break
                self._preempt(victim)
                preempted.add(victim.seq_id)
                if victim is seq:
                    break
            if seq.seq_id in preempted:
                continue
            if not self.kv.can_allocate(seq, n):
                if seq.status == SequenceStatus.RUNNING:
                    self._preempt(seq)
                    preempted.add(seq.seq_id)
                else:  # it waits: let go of the cached blocks it took on admission
                    self.kv.free(seq)
                    seq.num_computed = 0
                continue
            if seq.status == SequenceStatus.WAITING:
                self.waiting.remove(seq)
                self.running.append(seq)
                seq.status = SequenceStatus.RUNNING
                if seq.first_scheduled_time is None:
                    seq.first_scheduled_time = now
            self.kv.allocate(seq, n)
            done.append((seq, n))
            in_step.add(seq.seq_id)
        return StepPlan(done)  # type: ignore[arg-type]

    def _acquire_prefix(self, seq: Sequence) -> None:
        """Admit ``seq``'s cached prefix: hold the blocks the KV manager matched. If some were evicted
        since the match, computing starts earlier; what this step leaves, a later step computes."""
        if seq.request.sampling.prompt_logprobs is None:
            seq.num_computed = seq.num_cached_tokens = self.kv.acquire_prefix(seq)

    # -- preemption and swap ------------------------------------------------------------------------
    def _recompute_now(self, plan: StepPlan) -> bool:
        """``MIES_RECOMPUTE_THRESHOLD`` (spec §5.1, table 5-1): preempt (recompute or swap) for a running sequence
        the pool cannot grow this step only when the running sequences of the plan that can still be dispatched
        (whose blocks fit, in plan order, in what is free now) hold less than that share of the cache's blocks;
        otherwise the sequence waits a step with its blocks. A larger threshold preempts more readily. When no
        running sequence can be dispatched at all, it preempts whatever the threshold (0 included: nothing would
        ever run again). Decided once per step, at the first sequence that cannot grow."""
        if self._recompute is None:
            free, held = self.kv.num_free_blocks(), 0
            for view, n in plan.scheduled:
                seq = self.by_request.get(view.request_id)
                if seq is None or seq.status != SequenceStatus.RUNNING:
                    continue
                need = self.kv.blocks_needed(seq, min(n, seq.num_uncomputed))
                if need <= free:
                    free -= need
                    held += len(self.kv.block_table(seq)) + need
            share = held / max(self.kv.num_blocks, 1)
            self._recompute = held == 0 or share < self.limits.recompute_threshold
        return self._recompute

    def _pick_victim(self, needed_by: Sequence, exclude: set[int]) -> Sequence | None:
        """The running sequence to preempt for ``needed_by``: the ``mindie_host_preemption_victim`` hook's choice."""
        candidates = [s for s in self.running if s.seq_id not in exclude]
        if not candidates:
            return None
        victim = self.hook.mindie_host_preemption_victim(running=list(candidates), needed_by=needed_by)
        if not any(victim is s for s in candidates):
            log.error("mindie_host_preemption_victim answered %r, not a candidate; using the builtin choice", victim)
            victim = least_urgent(candidates)
        return victim  # type: ignore[return-value]

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks. With a swap space and room in this step's ``maxPreemptCount``,
        its KV is copied out and comes back later; otherwise it waits and is recomputed (no request is dropped)."""
        if self._swap_out(seq):
            return
        self.kv.free(seq)
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.waiting.insert(0, seq)
        self.counters["preemptions"] += 1
        log.info("preempted request %s (recompute later)", seq.request_id)

    def _swap_out(self, seq: Sequence) -> bool:
        """Copy ``seq``'s computed KV to the swap space and free its cache blocks; False when it cannot."""
        swap = self.swap
        table = self.kv.block_table(seq)[: -(-seq.num_computed // self.kv.block_size)]
        if swap is None or not table or self._swaps_this_step >= swap.max_per_step or swap.pool.num_free() < len(table):
            return False
        seq.swap_blocks = [swap.pool.allocate() for _ in table]
        self.backend.swap_out(table, seq.swap_blocks)
        self.kv.free(seq)
        self.running.remove(seq)
        seq.status = SequenceStatus.SWAPPED
        seq.num_preemptions += 1
        self.swapped.append(seq)
        self._swaps_this_step += 1
        self.counters["preemptions"] += 1
        self.counters["swapped_out"] += 1
        log.info("preempted request %s (swapped %d blocks to CPU)", seq.request_id, len(table))
        return True

    def _swap_in(self) -> None:
        """Bring swapped sequences back, oldest first, while the cache has room for them and a next token."""
        limit = self.limits.max_batch_size
        while self.swapped and len(self.running) < limit:
            seq = self.swapped[0]
            computed = seq.num_computed
            seq.num_computed = 0
            if self.kv.blocks_needed(seq, computed + 1) > self.kv.num_free_blocks():
                seq.num_computed = computed
                return
            self.kv.allocate(seq, computed)
            seq.num_computed = computed
            self.backend.swap_in(seq.swap_blocks, self.kv.block_table(seq))
            self._release_swap(seq)
            self.swapped.pop(0)
            self.running.append(seq)
            seq.status = SequenceStatus.RUNNING
            self.counters["swapped_in"] += 1

    def _release_swap(self, seq: Sequence) -> None:
        if self.swap is not None:
            for block in seq.swap_blocks:
                self.swap.pool.free(block)
        seq.swap_blocks = []

    # -- KV computed elsewhere ----------------------------------------------------------------------
    def reserve(self, seq: Sequence, num_tokens: int) -> list[int] | None:
        """Blocks for the first ``num_tokens`` tokens of a transferring ``seq``, whose KV was computed
        elsewhere: its block table, once the batch has a place and the cache room for them and a next
        token; None (nothing allocated) while it has not."""
        if len(self.running) >= self.limits.max_batch_size:
            return None
        if self.kv.blocks_needed(seq, num_tokens + 1) > self.kv.num_free_blocks():
            return None
        self.kv.allocate(seq, num_tokens)
        return self.kv.block_table(seq)

    def start_running(self, seq: Sequence, num_computed: int, now: float) -> None:
        """A transferring ``seq`` whose first ``num_computed`` tokens' KV was written into the blocks
        :meth:`reserve` gave joins the running batch."""
        seq.num_computed = num_computed
        self.kv.on_computed(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        seq.first_scheduled_time = now

    # -- the end ----------------------------------------------------------------------------------
    def finish(self, seq: Sequence, reason: str, free: bool = True) -> None:
        """End ``seq`` with finish reason ``reason``: out of its queue, its blocks freed (``free=False``
        keeps them: their new owner frees them later), and the ``mindie_host_request_finished`` hook told."""
        if seq.status == SequenceStatus.FINISHED:
            return
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
            self._release_swap(seq)
        elif seq.status == SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        if free:
            self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.counters[f"finished_{reason}"] += 1
        self.counters["prompt_tokens"] += seq.prompt_len
        self.by_request.pop(seq.request_id, None)
        try:
            self.hook.mindie_host_request_finished(request=seq.request, reason=reason)
        except Exception:  # a plugin's bookkeeping must not take the engine down
            log.exception("mindie_host_request_finished failed for %s", seq.request_id)

    def stats(self) -> dict[str, float]:
        """Queue depths, swap-space usage and the KV manager's block counts, for metrics."""
        s = {
            "num_running": float(len(self.running)),
            "num_waiting": float(len(self.waiting)),
            "num_swapped": float(len(self.swapped)),
            "swap_usage": self.swap.usage() if self.swap is not None else 0.0,
        }
        s.update(self.kv.stats())
        return s
