"""The CPU swap space: where a preempted sequence's KV waits instead of being thrown away and recomputed.

MindIE's ``maxPreemptCount`` (per scheduling round, at most that many sequences are
preempted by swapping) and ``cpuMemSize`` (the swap space, in GB) switch it on; the backend
copies blocks between its cache and the swap space (``ModelBackend.swap_out`` / ``swap_in``),
and this pool does the bookkeeping of the swap blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from .block_pool import RefCountedBlockPool


@dataclass
class SwapSpace:
    """Swap blocks (bookkeeping) and the per-step limit on swap preemptions."""

    pool: RefCountedBlockPool
    #: ``maxPreemptCount``: sequences preempted by swapping in one step, at most
    max_per_step: int

    def usage(self) -> float:
        """Fraction of the swap blocks in use (``cpu_cache_usage_perc``)."""
        return 1.0 - self.pool.num_free() / self.pool.num_blocks
