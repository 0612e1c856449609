"""``AtbBackend``: the host's torch backend on an :class:`NpuPlatform`, with NPU memory sizing."""

from __future__ import annotations

from typing import Any

from mindie_host.api import ModelSource
from mindie_host.backend_api import TorchBackend

from .platform import NpuPlatform

#: share of free NPU memory given to the KV cache when ``npuMemSize`` is -1 (automatic)
DEFAULT_MEMORY_FRACTION = 0.8


class KvBudgetError(RuntimeError):
    """``npuMemSize`` asks for more memory than the NPU has free."""


class AtbBackend(TorchBackend):
    """The host's :class:`~mindie_host.api.TorchLlama` run through :class:`NpuPlatform` (no model copy)."""

    backend_type = "atb"

    def __init__(self, source: ModelSource, *, name: str, dtype: str = "auto", platform: NpuPlatform,
                 memory_fraction: float = DEFAULT_MEMORY_FRACTION, progress: Any = None) -> None:
        super().__init__(source, name=name, dtype=dtype, platform=platform, progress=progress)
        self.memory_fraction = memory_fraction

    def available_kv_memory(self, requested_gb: int) -> int:
        """``npuMemSize`` GiB when set (refused if more than is free); else ``memory_fraction`` of free memory.

        Read after the weights are loaded, so "free" already excludes them.
        """
        free, total = self.platform.memory_info()
        if requested_gb > 0:
            want = requested_gb * (1 << 30)
            if want > free:
                raise KvBudgetError(
                    f"ModelConfig.npuMemSize is {requested_gb} GiB but the NPU has {free / 2**30:.2f} GiB free "
                    f"of {total / 2**30:.2f} GiB after loading the weights; lower npuMemSize or set it to -1 "
                    f"(use {self.memory_fraction:.0%} of free memory)"
                )
            return want
        return int(free * self.memory_fraction)
