"""Builtin plugin: the default scheduling policies and KV-cache manager.

Registered like any third-party plugin, so an enabled plugin's implementation of
the same firstresult hook takes precedence. What each ``ScheduleConfig`` value does:

* ``prefillPolicyType`` orders the waiting queue (admission): 0 FCFS; 1 STATE, which in the prefill
  stage is FCFS (as the spec defines it); 2 PRIORITY (the request's priority 1-5, then arrival);
  3 MLFQ, the spec's combination of 0 and 1: never-preempted sequences first, then once-preempted ...
  (:func:`~.policy.order_by_preemptions`).
* ``decodePolicyType`` orders the running batch: the order in which decodes get KV blocks, the
  ``maxBatchSize`` that decode when more hold blocks, and, from the end, the preemption victims:
  0 FCFS (admission order; victims by priority, then latest arrival); 1 STATE: sequences never
  preempted or swapped out first; 2 PRIORITY; 3 MLFQ as above.
* ``policyType`` (§7.6) replaces the admission order: 4 shortest job first, 5 longest job first;
  6 Skip-Join MLFQ (:mod:`.skip_join`) orders both queues and pauses the running jobs outside the
  top ``maxBatchSize``. 7 (SJF-MLFQ) is refused at startup (no published form to implement).

``ctx`` is the plugin contract's ``EngineContext`` (typed ``Any`` here: the contract sits on a floor
above the engine).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import hookimpl
from .kv_cache import KVCacheManager
from .policy import (
    SchedulerState,
    StepPlan,
    least_urgent,
    order_by_preemptions,
    order_fcfs,
    order_longest_first,
    order_priority,
    order_shortest_first,
    order_state,
    plan_standard,
)
from .sequence import SequenceView
from .skip_join import SkipJoinMLFQ, plan_skip_join

SKIP_JOIN_MLFQ = 6
Order = Callable[[list[SequenceView]], list[SequenceView]]
#: the waiting queue's order by ``prefillPolicyType`` (1, STATE, is FCFS in the prefill stage)
PREFILL_ORDERS: dict[int, Order] = {0: order_fcfs, 1: order_fcfs, 2: order_priority, 3: order_by_preemptions}
#: the running batch's order by ``decodePolicyType`` (0, FCFS, keeps the admission order)
DECODE_ORDERS: dict[int, Order] = {1: order_state, 2: order_priority, 3: order_by_preemptions}
#: the waiting queue's order by ``policyType`` when it is not 0 (FCFS) or 6 (Skip-Join MLFQ)
JOB_ORDERS: dict[int, Order] = {4: order_shortest_first, 5: order_longest_first}


class State:
    """Per-engine state of the builtin policy: the Skip-Join MLFQ's (``policyType`` 6)."""

    def __init__(self) -> None:
        self.mlfq = SkipJoinMLFQ()


@hookimpl(trylast=True)
def mindie_host_order_waiting(ctx: Any, waiting: list[SequenceView], now: float) -> list[SequenceView]:
    """``policyType`` 4/5/6 when set, else ``prefillPolicyType``."""
    schedule = ctx.config.BackendConfig.ScheduleConfig
    if schedule.policyType == SKIP_JOIN_MLFQ:
        return ctx.state.mlfq.order(waiting, now)  # type: ignore[no-any-return]
    order = JOB_ORDERS.get(schedule.policyType) or PREFILL_ORDERS[schedule.prefillPolicyType]
    return order(waiting)


@hookimpl(trylast=True)
def mindie_host_order_running(ctx: Any, running: list[SequenceView], now: float) -> list[SequenceView]:
    """``policyType`` 6 when set, else ``decodePolicyType`` (0 keeps the admission order)."""
    schedule = ctx.config.BackendConfig.ScheduleConfig
    if schedule.policyType == SKIP_JOIN_MLFQ:
        ordered: list[SequenceView] = ctx.state.mlfq.order(running, now)
        if schedule.templateType == "Mix":  # the Mix planner decodes the running batch every step
            ctx.state.mlfq.ran(ordered[: schedule.maxBatchSize], now)
        return ordered
    order = DECODE_ORDERS.get(schedule.decodePolicyType)
    return order(running) if order is not None else running


@hookimpl(trylast=True)
def mindie_host_plan_step(ctx: Any, state: SchedulerState) -> StepPlan:
    """MindIE's Standard template (under ``policyType`` 6, serving the top ``maxBatchSize`` of its queues)."""
    if state.config is not None and state.config.BackendConfig.ScheduleConfig.policyType == SKIP_JOIN_MLFQ:
        return plan_skip_join(state, ctx.state.mlfq)
    return plan_standard(state)


@hookimpl(trylast=True)
def mindie_host_preemption_victim(ctx: Any, running: list[SequenceView]) -> SequenceView:
    """FCFS and PRIORITY decode orders: the least urgent (highest ``priority`` number), then latest-arrived
    sequence; the other orders: the last in the running order (the candidates come in that order)."""
    schedule = ctx.config.BackendConfig.ScheduleConfig
    if schedule.policyType == SKIP_JOIN_MLFQ or schedule.decodePolicyType in (1, 3):
        return running[-1]
    return least_urgent(running)


@hookimpl(trylast=True)
def mindie_host_request_finished(ctx: Any, request: Any, reason: str) -> None:
    """Forget what the Skip-Join MLFQ kept about the request."""
    ctx.state.mlfq.forget(request.request_id)


@hookimpl(trylast=True)
def mindie_host_kv_cache_manager(ctx: Any, num_blocks: int, block_size: int) -> KVCacheManager:
    """Plain paged block accounting with no sharing."""
    return KVCacheManager(num_blocks, block_size)
