"""``AtbBackend``: the host's torch backend on an :class:`NpuPlatform`, with NPU memory sizing."""

from __future__ import annotations

from typing import Any

from mindie_host.api import ModelSource
from mindie_host.backend_api import ModelLoadError, TorchBackend

from .platform import NpuPlatform

#: share of free NPU memory given to the KV cache when ``npuMemSize`` is -1 (automatic)
DEFAULT_MEMORY_FRACTION = 0.8


class KvBudgetError(RuntimeError):
    """``npuMemSize`` asks for more memory than the NPU has free."""


class AtbBackend(TorchBackend):
    """The host's torch model run through :class:`NpuPlatform` (no model copy).

    Only the Llama family: the NPU operators are written and checked for its layers (other families' q/k norms,
    partial rotary and GELU would run, but unverified on an NPU), and the NPU's paged attention knows no sliding
    window, so a window that would hide part of a sequence is refused too.
    """

    backend_type = "atb"
    served_families = frozenset({"llama"})

    def __init__(self, source: ModelSource, *, name: str, dtype: str = "auto", platform: NpuPlatform,
                 memory_fraction: float = DEFAULT_MEMORY_FRACTION, progress: Any = None,
                 architectures: Any = None) -> None:
        super().__init__(source, name=name, dtype=dtype, platform=platform, progress=progress,
                         architectures=architectures)
        self.memory_fraction = memory_fraction

    def set_max_positions(self, max_positions: int) -> None:
        """As the torch backend; a sliding window shorter than ``max_positions`` is refused."""
        window = self.arch.sliding_window if self.arch is not None else None
        if window is not None and window < max_positions:
            raise ModelLoadError(f"the model's sliding_window is {window} but backendType 'atb' has no sliding-window "
                                 f"attention on the NPU; lower ModelDeployConfig.maxSeqLen to {window} or less, or "
                                 "use backendType 'torch'")
        super().set_max_positions(max_positions)

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
