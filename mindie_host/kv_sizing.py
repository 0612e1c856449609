"""How many KV-cache blocks the host allocates, and why (one line in the startup log).

The pool never exceeds what the scheduler can use at once: ``maxBatchSize`` sequences
of ``maxSeqLen`` tokens, that is ``maxBatchSize x ceil(maxSeqLen / cacheBlockSize)``
blocks (plus one). Within that, the memory budget decides:

* on the CPU: ``cpuMemSize`` GB (this host's deviation: MindIE's CPU swap space has no
  use here, since preempted requests are recomputed) and never more than 80% of the
  memory available now. The backend commits CPU pool memory only as blocks are
  written, so an idle server's resident memory does not include the unused pool;
* on a device (CUDA, NPU): ``npuMemSize`` GB, or 80% of free device memory when it is
  -1. ``cpuMemSize`` keeps the spec's meaning there (CPU swap space) and does not size
  the device pool.

``maxKvBlocks`` (this host's key) caps the result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .backends.base import ModelBackend
    from .config import Config

GIB = 1 << 30


@dataclass(frozen=True)
class KVPoolPlan:
    """The pool's size and the reason for it."""

    num_blocks: int
    block_size: int
    bytes_per_block: int
    wanted_blocks: int
    budget_bytes: int
    limited_by: str

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def describe(self, device: str) -> str:
        """The startup log line."""
        return (
            f"KV cache on {device}: {self.num_blocks} blocks x {self.block_size} tokens "
            f"({self.pool_bytes / GIB:.2f} GiB), limited by {self.limited_by}; the scheduler can use at most "
            f"{self.wanted_blocks} blocks ({self.wanted_blocks * self.bytes_per_block / GIB:.2f} GiB)"
            + ("; CPU pages are committed as blocks are used" if device == "cpu" else "")
        )


def plan_kv_pool(config: Config, backend: ModelBackend, device: str) -> KVPoolPlan:
    """Size the KV pool for ``backend`` on ``device`` (``cpu``, ``cuda``, ``npu`` ...) from ``config``."""
    sc, deploy, mc = config.schedule, config.deploy, config.model
    block_size = sc.cacheBlockSize
    per_block = backend.kv_cache_bytes_per_block(block_size)
    per_seq = math.ceil(deploy.maxSeqLen / block_size)
    wanted = sc.maxBatchSize * per_seq + 1
    if device == "cpu":
        available = backend.available_kv_memory(-1)
        if mc.cpuMemSize > 0 and mc.cpuMemSize * GIB < available:
            budget, why = mc.cpuMemSize * GIB, f"cpuMemSize={mc.cpuMemSize} GB"
        else:
            budget, why = available, f"80% of available memory ({available / 0.8 / GIB:.1f} GiB)"
    else:
        budget = backend.available_kv_memory(mc.npuMemSize if mc.npuMemSize != 0 else -1)
        why = f"npuMemSize={mc.npuMemSize} GB" if mc.npuMemSize > 0 else "80% of free device memory"
    num_blocks = max(1, budget // per_block)
    if num_blocks >= wanted:
        num_blocks = wanted
        why = f"maxBatchSize={sc.maxBatchSize} x ceil(maxSeqLen={deploy.maxSeqLen} / {block_size}) + 1"
    if mc.maxKvBlocks and mc.maxKvBlocks < num_blocks:
        num_blocks, why = mc.maxKvBlocks, f"maxKvBlocks={mc.maxKvBlocks}"
    return KVPoolPlan(int(num_blocks), block_size, per_block, wanted, int(budget), why)
