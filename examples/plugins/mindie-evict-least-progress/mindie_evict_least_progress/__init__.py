"""Evict the sequence that loses the least work: a complete mindie-host KV-eviction policy plugin.

When the KV block pool runs dry, the engine preempts a running sequence: its blocks
are freed and it is recomputed later. The builtin victim is the least urgent, latest
arrival. This plugin picks the sequence with the fewest computed tokens instead (the
cheapest to recompute), among those at the least urgent priority. Enable it with::

    "plugin_params": "{\\"plugin_type\\":\\"evict_least_progress\\"}"
    "Plugins": {"evict_least_progress": {"respectPriority": true}}
"""

from __future__ import annotations

from pydantic import BaseModel

from mindie_host.api import EngineContext, SequenceView, hookimpl


class Params(BaseModel):
    """``Plugins.evict_least_progress``."""

    #: only sequences at the least urgent priority are candidates (false: every running sequence)
    respectPriority: bool = True


@hookimpl
def mindie_host_preemption_victim(ctx: EngineContext, running: list[SequenceView]) -> SequenceView:
    """The candidate with the fewest computed tokens (ties: the latest arrival)."""
    if ctx.params.respectPriority:
        lowest = max(s.priority for s in running)
        running = [s for s in running if s.priority == lowest]
    return min(running, key=lambda s: (s.num_computed, -s.arrival_time))
