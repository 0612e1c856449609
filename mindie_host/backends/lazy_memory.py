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
from typing import Any

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


def trim_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc's ``malloc_trim``; nothing elsewhere).

    Loading a model frees many large temporaries (a tensor's dequantized or unpacked forms); glibc raises its mmap
    threshold after freeing large mapped blocks, so later ones come from the heap, and what they leave free stays
    resident: 330 MiB after loading a 3B Q4_0 model. The streaming loader calls this after each layer."""
    global _libc
    if _libc is None:
        import ctypes
        import ctypes.util

        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc = lib if hasattr(lib, "malloc_trim") else False
        except OSError:
            _libc = False
    if _libc:
        _libc.malloc_trim(0)


_libc: Any = None
