"""Builtin plugin: the default scheduling policy and KV-cache manager.

Registered like any third-party plugin, so an enabled plugin's implementation of
the same firstresult hook takes precedence.
"""

from __future__ import annotations

from typing import Any

from .. import hookimpl
from .kv_cache import KVCacheManager
from .policy import (
    SchedulerState,
    StepPlan,
    least_urgent,
    order_fcfs,
    order_longest_first,
    order_priority,
    order_shortest_first,
    plan_standard,
)
from .sequence import SequenceView


@hookimpl(trylast=True)
def mindie_host_order_waiting(waiting: list[SequenceView], config: Any, now: float) -> list[SequenceView]:
    """FCFS by default; ``prefillPolicyType`` 2 = priority; ``policyType`` 4/5 = SJF/LJF."""
    schedule = config.BackendConfig.ScheduleConfig
    if schedule.policyType == 4:
        return order_shortest_first(waiting)
    if schedule.policyType == 5:
        return order_longest_first(waiting)
    if schedule.prefillPolicyType == 2 or schedule.decodePolicyType == 2:
        return order_priority(waiting)
    return order_fcfs(waiting)


@hookimpl(trylast=True)
def mindie_host_plan_step(state: SchedulerState) -> StepPlan:
    """MindIE's Standard template."""
    return plan_standard(state)


@hookimpl(trylast=True)
def mindie_host_preemption_victim(running: list[SequenceView]) -> SequenceView:
    """The least urgent (highest ``priority`` number), then latest-arrived running sequence."""
    return least_urgent(running)


@hookimpl(trylast=True)
def mindie_host_kv_cache_manager(num_blocks: int, block_size: int, config: Any) -> KVCacheManager:
    """Plain paged block accounting with no sharing."""
    return KVCacheManager(num_blocks, block_size)
