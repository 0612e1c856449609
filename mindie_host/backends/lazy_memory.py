"""Zero-filled CPU tensors whose memory the OS commits only when it is written.

A KV-cache pool is sized for the most the scheduler could ever hold, but a server
usually holds far less. ``torch.zeros`` writes every byte, so the whole pool counts
against the process's resident memory from the start; an anonymous ``mmap`` is
zero-filled by the kernel page by page on first touch, so resident memory grows
with the blocks actually used.
"""

from __future__ import annotations

import math
import mmap

import torch

#: Below this size a plain ``torch.zeros`` is used (nothing to save).
LAZY_MIN_BYTES = 1 << 20


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.zeros(shape, dtype)``; on the CPU, large tensors are backed by anonymous, lazily committed memory."""
    count = math.prod(shape)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes < LAZY_MIN_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    # A private anonymous map: kernel-zeroed pages on first touch. (Python's default for -1 is a *shared* anonymous
    # map, which Linux backs with shmem: a 64-sequence decode step read its KV cache 25% slower from one.)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(shape)  # the tensor keeps the map alive


def resident_bytes() -> int:
    """This process's resident memory (RSS) in bytes, from ``/proc/self/statm`` (0 where that is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * mmap.PAGESIZE
    except (OSError, IndexError, ValueError):
        return 0
