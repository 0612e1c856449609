"""The CPU decode-attention kernel (``decode_attention.cpp``), built on first use.

Batch-invariant decoding runs attention one sequence at a time (bench/PERF.md, "Batch
invariance"). Through torch's operators that costs a gather, a dtype conversion and a
scaled-dot-product call per sequence and layer, about 90 µs each at 600 tokens of context:
two thirds of a 64-sequence decode step. The kernel does every generated token of a step in one
call, each (sequence, KV head) by one thread in a fixed order, reading the cache in place; its
output for a sequence is the same whatever shares the step.

It is compiled with the machine's C++ compiler through ``torch.utils.cpp_extension`` the first time
a process needs it (about 25 s) and loaded from torch's extension cache after that
(``TORCH_EXTENSIONS_DIR``). Without a compiler, or with ``MINDIE_HOST_CPU_KERNELS=0``, decode
attention stays on torch's operators (logged once).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("mindie_host.backends")

SOURCE = Path(__file__).with_name("decode_attention.cpp")
_lock = threading.Lock()
_module: Any = None
_tried = False


def enabled() -> bool:
    """Whether the kernel may be used (``MINDIE_HOST_CPU_KERNELS=0`` turns it off)."""
    return os.environ.get("MINDIE_HOST_CPU_KERNELS", "1") != "0"


def kernel() -> Any:
    """The built extension module, or None when it is off or cannot be built (tried once per process)."""
    global _module, _tried
    if _tried or not enabled():
        return _module
    with _lock:
        if not _tried:
            try:
                from torch.utils.cpp_extension import load

                _module = load(
                    name="mindie_host_decode_attention",
                    sources=[str(SOURCE)],
                    extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                    extra_ldflags=["-fopenmp"],
                    verbose=False,
                )
            except Exception as exc:  # no compiler, no headers: torch's operators serve instead
                log.warning("the CPU decode-attention kernel could not be built (%s); decode attention runs on "
                            "torch's operators", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            _tried = True
    return _module


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     context_lens: torch.Tensor, scale: float) -> torch.Tensor | None:
    """Attention of one query token per sequence over its cached context, or None when the kernel is unavailable.

    ``q``: ``[B, H, D]`` float32; caches ``[slots, KV, D]`` (bfloat16 or float32, contiguous); ``slots``:
    ``[B, >= max context]`` int64 cache slots of each sequence's context; ``context_lens``: ``[B]`` int64.
    Returns ``[B, H, D]`` float32.
    """
    mod = kernel()
    if mod is None or k_cache.dtype not in (torch.bfloat16, torch.float32) or not k_cache.is_contiguous():
        return None
    return mod.decode_attention(q.float().contiguous(), k_cache, v_cache, slots.contiguous(), context_lens, scale)

